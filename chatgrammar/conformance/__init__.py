"""Checking specs and templates: the sandboxed renderer, the conversation matrix, template checks,
spec validation, format test data, inference.
"""
