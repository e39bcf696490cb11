"""Operator routes: models, health, metrics, memory, dashboard, tokenize and the imprint routes."""
