"""The compiler as passes over a compile state (``fusion.compile.compile_model`` runs them).

:mod:`.state`: the request and the state every pass reads and returns; :mod:`.steps`: the passes and
:data:`~.steps.PASSES`, their order (the one place a pass is added); :mod:`.pricing`, :mod:`.cut`,
:mod:`.bottleneck`, :mod:`.assemble`: what the passes ask the estimator and the partitioners.
"""
