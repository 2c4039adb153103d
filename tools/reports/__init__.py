"""Markdown tables and PNG plots from `rimuru bench` records."""
