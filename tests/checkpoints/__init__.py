"""Checkpoints: save, resume (bitwise, at another world size), manifests, consolidation, and
checkpoints of DeepSpeed runs."""
