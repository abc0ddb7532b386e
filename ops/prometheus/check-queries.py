"""Every dashboard panel and every rule returns data from a real Prometheus.

usage: check-queries.py PROMETHEUS_URL RULES_YML DASHBOARD_JSON...

- A panel passes when at least one of its queries returns a series (one panel may show an
  error counter next to the normal series: nothing to show is fine for that one), and no
  query of it fails to evaluate. `$instance` and other variables match everything.
- An alert passes when the left side of its threshold (`expr > 0.9` -> `expr`) returns a
  series, so the expression measures something that exists; a recording rule when its
  expression does.
Exits 1 listing every failure.
"""
import json
import re
import sys
import urllib.parse
import urllib.request

COMPARISON = re.compile(r"\s(==|!=|>=|<=|>|<)\s*[-0-9.e]+\s*$")


def query(base, expr):
    url = base + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.load(response)
    except urllib.error.HTTPError as e:
        return None, e.read().decode(errors="replace")
    if body.get("status") != "success":
        return None, body.get("error", "query failed")
    return body["data"]["result"], None


def rules(path):
    """(kind, name, expression) of every rule in a Prometheus rules file (PyYAML-free: the
    file's layout is ours, one `- alert:`/`- record:` line followed by `expr:`)."""
    out, current = [], None
    for line in open(path):
        stripped = line.strip()
        for kind in ("alert", "record"):
            if stripped.startswith(f"- {kind}:"):
                current = (kind, stripped.split(":", 1)[1].strip())
        if stripped.startswith("expr:") and current:
            out.append((current[0], current[1], stripped.split(":", 1)[1].strip()))
            current = None
    return out


def main():
    base, rules_path, dashboards = sys.argv[1].rstrip("/"), sys.argv[2], sys.argv[3:]
    failures, checked = [], 0
    for path in dashboards:
        board = json.load(open(path))
        for panel in board["panels"]:
            found = False
            for target in panel.get("targets", []):
                expr = re.sub(r'=~"\$\w+"', '=~".*"', target["expr"])
                result, error = query(base, expr)
                if error:
                    failures.append(f"{path}: panel '{panel['title']}': {expr}: {error}")
                found |= bool(result)
            checked += 1
            if not found:
                failures.append(f"{path}: panel '{panel['title']}' shows no data")
    for kind, name, expr in rules(rules_path):
        measured = COMPARISON.sub("", expr) if kind == "alert" else expr
        result, error = query(base, measured)
        checked += 1
        if error:
            failures.append(f"{kind} {name}: {measured}: {error}")
        elif not result:
            failures.append(f"{kind} {name}: {measured} returns no data")
    for failure in failures:
        print("FAIL", failure)
    print(f"{checked - len(failures)}/{checked} panels and rules return data")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
