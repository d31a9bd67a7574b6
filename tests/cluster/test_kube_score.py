"""kube-score on the chart (default values) and on rendered worker Pods and children.

Every CRITICAL finding left must be listed as by design, with its reason, in
docs/operator.md; a new finding, or a listed one that no longer occurs, fails.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from dlo_operator.api import DiffusionDeploymentSpec
from dlo_operator.render import Owner, render_children, render_engine_pods
from tests.cluster.helpers import helm_template
from tests.harness.build import Builder

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "examples" / "diffusiondeployment.yaml"
DOCS = ROOT / "docs" / "operator.md"
VARIANTS = {
    "flux": {},
    "cached": {
        "lockedMemory": "IpcLock",
        "offload": {"useAllGather": False, "runtimeCache": {"enabled": True}},
    },
    "limited": {"lockedMemory": "NriUlimit", "networkPolicy": {"enabled": False}},
}
"""The example, and the example with every option that changes a Pod's security."""

_FINDING = re.compile(
    r"^\[CRITICAL\] \S+ (?P<kind>[\w./]+): (?:\((?P<container>[\w-]+)\) )?(?P<text>.+)$"
)
_DOCUMENTED = re.compile(r"^\| (?P<kind>\w+) \| `(?P<container>[\w-]+)` \| (?P<text>[^|]+?) \|")


def _rendered_objects() -> list[dict]:
    base = yaml.safe_load(EXAMPLE.read_text())["spec"]
    items: list[dict] = []
    for name, overrides in VARIANTS.items():
        spec = DiffusionDeploymentSpec.model_validate({**base, **overrides})
        owner = Owner(name, "serving", "uid")
        for engine in range(spec.replicas):
            items += render_engine_pods(owner, spec, engine)
        items += render_children(owner, spec, ["node-a"])  # with the cache: a warm Job
    return items


def _critical(objects: list[dict], path: Path) -> set[tuple[str, str, str]]:
    path.write_text(yaml.safe_dump_all(objects))
    result = subprocess.run(
        [str(Builder().bin / "kube-score"), "score", "--output-format", "ci", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.stdout, result.stderr
    found = set()
    for line in result.stdout.splitlines():
        if match := _FINDING.match(line):
            kind = match["kind"].rsplit("/", 1)[-1]
            found.add((kind, match["container"] or "-", match["text"].strip()))
    return found


def _documented() -> set[tuple[str, str, str]]:
    section = DOCS.read_text().split("### kube-score findings kept by design", 1)[1]
    return {
        (m["kind"], m["container"], m["text"].strip())
        for line in section.splitlines()
        if (m := _DOCUMENTED.match(line))
    }


def test_every_critical_finding_is_documented_as_by_design(tmp_path: Path) -> None:
    chart = _critical(helm_template(), tmp_path / "chart.yaml")
    workers = _critical(_rendered_objects(), tmp_path / "workers.yaml")
    assert chart | workers == _documented()
