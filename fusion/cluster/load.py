"""Reading a cluster: a YAML or JSON file in either format, or the name of a shipped scenario.

:func:`load_cluster` is the one entry (``--cluster`` of every command): it tells the
formats apart (a ``bandwidth_bps`` key: the scenario format of :meth:`Cluster.from_dict`;
otherwise the readable YAML format of :mod:`fusion.cluster.yaml_format`), falls back to
the shipped scenarios (:mod:`fusion.cluster.scenarios`) for a name that is no file, and
puts the line and column of the offending YAML node into a format's error message.
The model itself (:mod:`fusion.cluster.model`) knows no files.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from fusion.cluster.model import Cluster, ClusterError
from fusion.cluster.scenarios import load_scenario, scenario_names
from fusion.cluster.yaml_format import cluster_from_yaml


def load_cluster(path: str | Path) -> Cluster:
    """Load a cluster from YAML (readable format or scenario format) or scenario JSON,
    or name a shipped scenario (``fusionllm-48``; see :mod:`fusion.cluster.scenarios`)."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        if str(path) in scenario_names():
            return load_scenario(str(path))
        raise ClusterError(f"{path}: no such cluster file, nor a shipped scenario "
                           f"({', '.join(scenario_names())})") from None
    except OSError as e:
        raise ClusterError(f"{path}: cannot read cluster file ({e})") from None
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ClusterError(f"{path}: not valid JSON ({e})") from None
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            context = getattr(e, "context", None)
            raise ClusterError(f"{where}: not valid YAML: {problem}" + (f" ({context})" if context else "")) from None
        try:
            if isinstance(data, dict) and "bandwidth_bps" in data:
                return Cluster.from_dict(data, str(path))
            return cluster_from_yaml(data, str(path))
        except ClusterError as e:
            raise ClusterError(_with_yaml_position(str(e), str(path), text)) from None
    if isinstance(data, dict) and "bandwidth_bps" in data:
        return Cluster.from_dict(data, str(path))
    return cluster_from_yaml(data, str(path))


_FIELD = re.compile(r"\.?([A-Za-z_][\w\-]*)|\[(\d+)\]|\s\([^)]*\)")


def _with_yaml_position(msg: str, source: str, text: str) -> str:
    """``FILE: devices[1] (gpu).memory: ...`` -> ``FILE:LINE:COL: devices[1] (gpu).memory: ...``: the line and
    column of the deepest YAML node the message's field path reaches (unchanged when it names none)."""
    import yaml

    prefix = f"{source}: "
    if not msg.startswith(prefix):
        return msg
    rest = msg[len(prefix):]
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return msg
    found = None
    pos = 0
    while node is not None and pos < len(rest):
        m = _FIELD.match(rest, pos)
        if not m:
            break
        pos = m.end()
        key, index = m.group(1), m.group(2)
        if key is None and index is None:
            continue  # " (device name)"
        nxt = None
        if key is not None and isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if getattr(k, "value", None) == key:
                    nxt = v
                    break
        elif index is not None and isinstance(node, yaml.SequenceNode) and int(index) < len(node.value):
            nxt = node.value[int(index)]
        if nxt is None:
            break
        node = found = nxt
    if found is None:
        return msg
    mark = found.start_mark
    return f"{source}:{mark.line + 1}:{mark.column + 1}: {rest}"
