"""Run control: the composed settings and DVC's params file, MLflow tracking, the run's deadline, the held-out split
by prompt and the prompt files the stages meet on."""
