"""What the CLI tests share: model files they write and name as MODEL (``file.py:function``), free ports."""
import socket

#: a two-layer CNN built node by node; its traced micro-batch is 2 rows
CNN_SRC = '''
import torch
from fusion.ir.builder import GraphBuilder

def cnn():
    b = GraphBuilder()
    x, y = b.input("x"), b.label("y")
    h = b.module("conv", "torch.nn.Conv2d", x, in_channels=3, out_channels=4, kernel_size=3, padding=1)
    h = b.function("flat", "torch.flatten", h, 1)
    o = b.module("fc", "torch.nn.Linear", h, in_features=4 * 6 * 6, out_features=5)
    b.loss("loss", "torch.nn.functional.cross_entropy", o, y)
    return b.build(example={"x": torch.randn(2, 3, 6, 6), "y": torch.randint(0, 5, (2,))}, seed=0)
'''


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports free at the time of the call."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
