"""E2B's API, served by the service: its control plane (routes.py, over sandboxes.py)
and envd, its in-sandbox API (envd.py, over Connect's protocol: connect.py), so that
E2B's own SDK drives sandman's sandboxes with only its URLs and key changed."""
