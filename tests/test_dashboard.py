"""The Grafana dashboard (dashboards/sandman_pools.json) asks only for what the pool
exports: every metric a panel's query names is one that sandman_ray/pool/metrics.py
defines, under the name Ray's Prometheus export gives it, and every label it filters or
groups by is one of that metric's tags (or Ray's own ``le`` and ``SessionName``). The
live half, that the export carries these names and labels, is in test_observability.py
(``test_metrics_endpoint_shows_the_pool_during_a_burst``)."""

import ast
import json
import re

from conftest import ROOT

DASHBOARD = ROOT / "dashboards" / "sandman_pools.json"
METRICS = ROOT / "sandman_ray" / "pool" / "metrics.py"
RAY_LABELS = {"SessionName"}  # Ray adds it to every exported series


def defined_metrics() -> dict:
    """{exported series name: its label names}, from metrics.py's metric definitions:
    Ray exports ``NAME`` as ``ray_NAME``, a counter with ``_total``, a histogram as
    ``_bucket`` (with ``le``), ``_count`` and ``_sum``."""
    suffixes = {"Gauge": [""], "Counter": ["_total"],
                "Histogram": ["_bucket", "_count", "_sum"]}
    found = {}
    for node in ast.walk(ast.parse(METRICS.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in suffixes:
            name = ast.literal_eval(node.args[0])
            tags = next(ast.literal_eval(k.value) for k in node.keywords if k.arg == "tag_keys")
            for suffix in suffixes[node.func.attr]:
                found["ray_" + name + suffix] = set(tags) | (
                    {"le"} if suffix == "_bucket" else set())
    return found


def queries(dashboard: dict) -> list:
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"]
              if v["type"] == "query"]
    return exprs


def test_every_query_names_a_metric_the_pool_exports_with_its_labels():
    dashboard = json.loads(DASHBOARD.read_text())
    exported = defined_metrics()
    assert len(exported) >= 15  # the parse found the definitions
    named = set()
    for expr in queries(dashboard):
        metrics = re.findall(r"\bray_sandman_\w+", expr)
        assert metrics, "a query that names no sandman metric: %s" % expr
        for metric in metrics:
            assert metric in exported, "%s names %s, which the pool does not export" % (
                expr, metric)
            named.add(metric)
        labels = set(re.findall(r"(\w+)\s*=~?\s*\"", expr))  # selectors
        for group in re.findall(r"by \(([^)]*)\)", expr):  # aggregations
            labels |= {label.strip() for label in group.split(",")}
        labels |= set(re.findall(r"label_values\([^,]*,\s*(\w+)\)", expr))
        for metric in metrics:
            unknown = labels - exported[metric] - RAY_LABELS
            assert not unknown, "%s uses labels %s that %s does not have" % (
                expr, unknown, metric)
    # every family the pool exports has a panel
    families = {re.sub(r"_(bucket|count|sum)$", "", m) for m in named}
    assert families >= {re.sub(r"_(bucket|count|sum)$", "", m) for m in exported}


def test_the_dashboard_is_one_grafana_loads():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 27
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "SessionName", "pool"} <= variables
    for panel in dashboard["panels"]:
        assert panel["datasource"] == "${datasource}" and panel["targets"]
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs))
        for target in panel["targets"]:
            expr = target["expr"]
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}")
            for selector in re.findall(r"\{([^}]*)\}", expr):
                assert 'pool=~"$pool"' in selector, "%s ignores the pool variable" % expr
