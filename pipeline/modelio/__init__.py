"""Model I/O: resolving, converting and loading the target and draft (pinned PyPI packages, local directories), the
dtype a device runs them in (measured), building a draft (derived, pretrained, pruned), the chat template and
stop ids, and reading a trained draft's record."""
