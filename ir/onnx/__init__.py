"""ONNX import: an ONNX file becomes an :class:`~fusion.ir.graph.OpGraph`.

- :mod:`fusion.ir.onnx.read`: the protobuf read, constant folding and static-input evaluation.
- :mod:`fusion.ir.onnx.ops`: what each ONNX operator's inputs and attributes mean (engine-free).
- :mod:`fusion.ir.onnx.resize`: Resize/Upsample arithmetic shared by the engines.
- :mod:`fusion.ir.onnx.semantics`: the operators written in torch (the torch engine's semantics).
- :mod:`fusion.ir.onnx.importer`: :func:`load_onnx`, the front end.
"""
