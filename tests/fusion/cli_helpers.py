"""What the CLI tests share: model files they write and name as MODEL (``file.py:function``), the one-line
error check of an in-process CLI call, free ports."""
import signal
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


def cnn_model(tmp_path) -> str:
    """Write :data:`CNN_SRC` to ``tmp_path/model.py``; its MODEL name (``file.py:cnn``)."""
    (tmp_path / "model.py").write_text(CNN_SRC)
    return f"{tmp_path / 'model.py'}:cnn"


def one_line(capsys) -> str:
    """What an in-process ``fusion.cli.main`` call wrote to stderr, which must be exactly one line."""
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


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


def sigint_default() -> None:
    """``preexec_fn`` for a child a test interrupts with SIGINT: give it the default disposition, so that
    Python turns Ctrl-C into KeyboardInterrupt even when the test run itself was started with SIGINT ignored
    (a background job of a non-interactive shell, which every child would otherwise inherit)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
