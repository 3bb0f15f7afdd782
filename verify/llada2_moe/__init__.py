"""dlm-verify for LLaDA-2: ``adapter`` implements dlm.verify.protocol;
``torch_model`` is dlm's independent PyTorch reference written from the hub
``modeling_llada2_moe.py`` (inclusionAI/LLaDA2.0-mini); ``remote`` loads a checkpoint's own modeling code instead
(only with --trust-remote-code)."""
