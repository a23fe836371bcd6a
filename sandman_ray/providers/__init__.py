"""Sandbox providers: create, delete, list and locate sandboxes."""
