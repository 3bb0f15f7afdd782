"""Model-card templates rendered by dlm-convert and filled by dlm-verify."""
