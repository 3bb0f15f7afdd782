"""dlm-verify: prove a converted MLX model faithful to its PyTorch reference.

Layout: ``protocol.py`` (the family plug-in protocol: read it before adding a
family), ``<family>/`` (one adapter package per family, found through
``dlm.runtime.registry``), ``suite.py`` (record / run_parity orchestration),
``parity_report.py`` (run_parity's rows and report), ``metrics.py`` / ``thresholds.py`` / ``checks.py`` (shared numbers and
verdicts), ``weights.py`` / ``dequant.py`` (precision, dequantized weights), ``source.py`` /
``prompts.py`` / ``budget.py`` (reference resolution, prompt ids, how many
prompts, canvases and steps), ``bundle.py`` (record once,
compare anywhere), ``streaming.py`` / ``lockstep.py`` (layer-streamed
references, passes sharing layer loads), ``report.py`` (JSON, terminal table, model-card section),
``cli.py``.
"""
