"""dlm-verify: prove a converted MLX model faithful to its PyTorch reference.

Layout: ``protocol.py`` (the family plug-in protocol: read it before adding a
family), ``reference_<family>.py`` (one adapter per family, found through
``dlm.runtime.registry``), ``suite.py`` (record / run_parity orchestration),
``metrics.py`` / ``thresholds.py`` / ``checks.py`` (shared numbers and
verdicts), ``weights.py`` / ``dequant.py`` (precision, dequantized weights), ``source.py`` /
``prompts.py`` (reference resolution, prompt ids), ``bundle.py`` (record once,
compare anywhere), ``streaming.py`` / ``lockstep.py`` (layer-streamed
references, passes sharing layer loads), ``report.py`` (JSON, terminal table, model-card section),
``cli.py``.
"""
