"""Draft-model distillation pipeline: prepare -> collect -> distill -> eval."""
