"""Model: what every front end returns and what ``fusion compile`` consumes."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fusion.ir.graph import OpGraph


@dataclass
class Model:
    """An OP-DAG with its initial weights and an example micro-batch.

    graph:   the validated OP-DAG with shapes filled in.
    params:  graph parameter name -> initial value (torch tensor or NumPy array);
             empty for graphs built on the meta device (compile-only).
    example: placeholder name -> example value of one micro-batch, which
             fixes the static shapes the graph was traced at.
    """

    graph: OpGraph
    params: dict[str, Any] = field(default_factory=dict)
    example: dict[str, Any] = field(default_factory=dict)
