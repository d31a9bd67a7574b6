"""The ``dlo-worker`` commands: thin entry points that parse flags and hand a resolved
configuration to the layers below."""
