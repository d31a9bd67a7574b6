"""Generate the DiffusionDeployment CRD from the pydantic models (pure).

Kubernetes wants a *structural* OpenAPI v3 schema: every node typed, no ``$ref``,
no ``anyOf`` for nullability, no ``additionalProperties: false``, free-form
objects marked ``x-kubernetes-preserve-unknown-fields``. :func:`structural`
rewrites pydantic's JSON Schema into that form; :func:`custom_resource_definition`
wraps it with names, subresources and printer columns.

    python -m dlo_operator.crd > crds/diffusiondeployments.dlo.dev.yaml
    python -m dlo_operator.crd --chart > charts/dlo-operator/templates/crd.yaml
"""

from __future__ import annotations

import sys
from typing import Any

import yaml
from pydantic import BaseModel

from dlo_operator.api import (
    GROUP,
    KIND,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
    DiffusionDeploymentSpec,
    DiffusionDeploymentStatus,
)

_DROPPED_KEYS = {"title", "$defs"}


def _without_nulls(value: Any) -> Any:
    """Defaults must not carry nulls for fields that are not nullable."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value


def _resolve(schema: dict[str, Any], definitions: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in schema:
        target = definitions[schema["$ref"].rsplit("/", 1)[-1]]
        schema = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
    if "anyOf" in schema:
        options = [option for option in schema["anyOf"] if option.get("type") != "null"]
        if len(options) != 1:
            raise ValueError(f"cannot express a union of {len(options)} types structurally")
        rest = {k: v for k, v in schema.items() if k != "anyOf"}
        schema = {**_resolve(options[0], definitions), **rest}
    return schema


def structural(schema: dict[str, Any], definitions: dict[str, Any] | None = None) -> dict:
    """A structural Kubernetes schema equivalent to a pydantic JSON Schema node."""
    definitions = definitions if definitions is not None else schema.get("$defs", {})
    schema = _resolve(schema, definitions)
    result: dict[str, Any] = {}
    for key, raw in schema.items():
        if key in _DROPPED_KEYS or (key == "default" and raw is None):
            continue
        value = raw
        if key == "description":
            value = raw.replace("``", "`")
        elif key == "default":
            value = _without_nulls(raw)
        if key == "properties":
            result[key] = {name: structural(sub, definitions) for name, sub in value.items()}
        elif key == "items":
            result[key] = structural(value, definitions)
        elif key == "additionalProperties":
            if value is True or value == {}:
                result["x-kubernetes-preserve-unknown-fields"] = True
            elif isinstance(value, dict):
                result[key] = structural(value, definitions)
        elif key == "exclusiveMinimum":
            result["minimum"], result["exclusiveMinimum"] = value, True
        else:
            result[key] = value
    if (
        result.get("type") == "object"
        and "properties" not in result
        and ("additionalProperties" not in result)
    ):
        result["x-kubernetes-preserve-unknown-fields"] = True
    return result


def _model_schema(model: type[BaseModel]) -> dict[str, Any]:
    return structural(model.model_json_schema(by_alias=True, mode="validation"))


def custom_resource_definition() -> dict[str, Any]:
    """The complete CRD object for ``diffusiondeployments.dlo.dev``."""
    spec_schema = _model_schema(DiffusionDeploymentSpec)
    status_schema = _model_schema(DiffusionDeploymentStatus)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": ["all"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": [
                        {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"},
                        {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
                        {
                            "name": "Up-to-date",
                            "type": "integer",
                            "jsonPath": ".status.updatedReplicas",
                        },
                        {
                            "name": "Available",
                            "type": "string",
                            "jsonPath": '.status.conditions[?(@.type=="Available")].status',
                        },
                        {
                            "name": "Degraded",
                            "type": "string",
                            "description": "Why an engine does not run (Degraded's reason).",
                            "jsonPath": '.status.conditions[?(@.type=="Degraded")].reason',
                        },
                        {
                            "name": "Cache",
                            "type": "string",
                            "description": "Nodes whose runtime cache is warm / eligible nodes.",
                            "jsonPath": ".status.cache.warm",
                        },
                        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                    ],
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "A set of DLO diffusion engines serving one model.",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {
                                    "type": "string",
                                    "description": f"{GROUP}/{VERSION}",
                                },
                                "kind": {"type": "string", "description": KIND},
                                # The API server allows nothing else here: kubectl
                                # explain shows ObjectMeta's own descriptions.
                                "metadata": {"type": "object"},
                                "spec": spec_schema,
                                "status": status_schema,
                            },
                        }
                    },
                }
            ],
        },
    }


_HEADER = "# Generated by `python -m dlo_operator.crd` from dlo_operator/api.py; do not edit.\n"
CHART_TEMPLATE = "charts/dlo-operator/templates/crd.yaml"


def render_yaml() -> str:
    """The CRD as committed under ``crds/`` (for ``kubectl apply``)."""
    return _HEADER + yaml.safe_dump(custom_resource_definition(), sort_keys=False, width=100)


def render_chart_template() -> str:
    """The CRD as a Helm template: upgraded by ``helm upgrade``, kept on uninstall."""
    crd = custom_resource_definition()
    crd["metadata"]["annotations"] = {"helm.sh/resource-policy": "keep"}
    body = yaml.safe_dump(crd, sort_keys=False, width=100)
    return f"{_HEADER}{{{{- if .Values.crd.install }}}}\n{body}{{{{- end }}}}\n"


if __name__ == "__main__":
    sys.stdout.write(render_chart_template() if "--chart" in sys.argv else render_yaml())
