"""The workbench beside the pipeline: `python -m pipeline.tools <subcommand> [hydra overrides]` (see __main__.py)."""
