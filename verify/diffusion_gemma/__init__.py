"""dlm-verify for DiffusionGemma: ``adapter`` implements dlm.verify.protocol
around the reference, which is transformers' own DiffusionGemma class."""
