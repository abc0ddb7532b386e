#!/usr/bin/env python3
"""Validates rendered racekv manifests (validate.sh renders each overlay and runs this).

    validate.py --kubernetes-version 1.30.0 rendered/dev.yaml rendered/production.yaml ...

Every object is checked against a schema, strictly (a field the schema does not declare is
an error, as with the API server's strict field validation):

* Kubernetes' own kinds against kubernetes-validate's schemas for the pinned version;
* custom resources (KEDA's ScaledObject, the Prometheus Operator's ServiceMonitor and
  PrometheusRule) against the openAPIV3Schema of their CustomResourceDefinitions: the real
  ones in crds/*.yaml when vendored there (crds/NEEDED.md), else the hand-written stand-ins
  in schemas/minimal-crds.yaml; the summary says which. Their metadata is checked as
  ObjectMeta.

Then what schemas cannot see, across the objects of one overlay: unique names; workload
selectors match their pod templates; every Service, PodDisruptionBudget, NetworkPolicy and
ServiceMonitor selects something, and the ports they name exist there; volumes mounted
exist; the ScaledObject's target exists and leaves replicas to KEDA; every
RACEKV_MEMNODE_* / RACEKV_COMPUTENODE_* variable is a setting the daemon has
(memnode/src/config.rs, computenode/src/config.rs); the computenodes' memnode list names
every memnode of the StatefulSet on the right port; the PrometheusRule carries exactly the
groups of ops/prometheus/racekv-rules.yml.

Exit status 1 on any error.
"""
import argparse
import copy
import glob
import os
import re
import sys

import jsonschema
import kubernetes_validate
import yaml
from kubernetes_validate import utils as kv_utils
from referencing import Registry, Resource

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# Secrets the operator creates (README: "Secrets"), with the keys the pods read.
EXTERNAL_SECRETS = {"racekv-secrets": {"token", "requirepass"}}
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet")


class Report:
    def __init__(self):
        self.errors = []

    def error(self, where, message):
        self.errors.append(f"{where}: {message}")


def ident(obj):
    meta = obj.get("metadata", {})
    return f"{obj.get('kind')}/{meta.get('name')}"


# ---- custom resource schemas -------------------------------------------------------------

def strict(schema):
    """The schema with unknown fields refused wherever it declares properties (the API
    server prunes or, with strict field validation, rejects them)."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def load_crds(report, k8s_version, minimal_only=False):
    """{(group, version, kind): (schema, source)} from crds/*.yaml, else the stand-ins."""
    found = {}
    vendored = [] if minimal_only else sorted(glob.glob(os.path.join(HERE, "crds", "*.yaml")))
    sources = [(p, "vendored CRD") for p in vendored]
    sources.append((os.path.join(HERE, "schemas", "minimal-crds.yaml"), "minimal hand-written schema"))
    for path, label in sources:
        with open(path) as f:
            docs = [d for d in yaml.safe_load_all(f) if d]
        for crd in docs:
            if crd.get("kind") != "CustomResourceDefinition":
                continue
            where = f"{os.path.relpath(path, ROOT)} {ident(crd)}"
            try:
                kubernetes_validate.validate(crd, k8s_version, strict=True)
            except Exception as e:  # noqa: BLE001: every failure is reported the same way
                report.error(where, f"not a valid CustomResourceDefinition: {getattr(e, 'message', e)}")
                continue
            spec = crd["spec"]
            for version in spec["versions"]:
                key = (spec["group"], version["name"], spec["names"]["kind"])
                if key in found:  # vendored files come first and win
                    continue
                schema = version.get("schema", {}).get("openAPIV3Schema")
                if schema is None:
                    report.error(where, f"version {version['name']} has no openAPIV3Schema")
                    continue
                found[key] = (strict(schema), f"{label} ({os.path.relpath(path, ROOT)})")
    return found


def k8s_registry(k8s_version):
    defs = kv_utils.schema_contents(f"kubernetes-json-schema/v{k8s_version}-local-strict/_definitions.json", k8s_version)
    return Resource.from_contents(defs) @ Registry()


def k8s_definition(registry, name):
    return jsonschema.Draft202012Validator(
        {"$ref": f"https://kubernetes.io/api/_definitions.json#/$defs/{name}"}, registry=registry
    )


def validate_schema(obj, where, crds, used, registry, k8s_version, report):
    group, _, version = obj.get("apiVersion", "").rpartition("/")
    key = (group, version, obj.get("kind"))
    if key in crds:
        schema, source = crds[key]
        used[f"{group}/{version} {obj['kind']}"] = source
        validator = jsonschema.Draft7Validator(schema)
        for e in sorted(validator.iter_errors(obj), key=lambda e: list(e.path)):
            report.error(where, f"{'.'.join(map(str, e.path)) or '(top)'}: {e.message}")
        for e in k8s_definition(registry, "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta").iter_errors(obj.get("metadata", {})):
            report.error(where, f"metadata.{'.'.join(map(str, e.path))}: {e.message}")
        behavior = obj.get("spec", {}).get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("behavior")
        if obj["kind"] == "ScaledObject" and behavior is not None:
            v = k8s_definition(registry, "io.k8s.api.autoscaling.v2.HorizontalPodAutoscalerBehavior")
            for e in v.iter_errors(behavior):
                report.error(where, f"spec.advanced.horizontalPodAutoscalerConfig.behavior.{'.'.join(map(str, e.path))}: {e.message}")
        return
    if "." in group and not group.endswith(".k8s.io"):
        report.error(where, f"no schema for the custom resource {obj.get('apiVersion')} {obj.get('kind')}")
        return
    try:
        kubernetes_validate.validate(obj, k8s_version, strict=True)
        used[f"{obj['apiVersion']} {obj['kind']}"] = f"Kubernetes {k8s_version} (kubernetes-validate, strict)"
    except kv_utils.ValidationError as e:
        report.error(where, f"{'.'.join(map(str, e.path)) or '(top)'}: {e.message}")
    except kv_utils.SchemaNotFoundError as e:
        report.error(where, e.message)


# ---- what schemas do not see ---------------------------------------------------------------

def matches(selector, labels):
    """A label selector (matchLabels / matchExpressions, or a plain map) against labels."""
    if selector is None:
        return False
    plain = "matchLabels" not in selector and "matchExpressions" not in selector
    match_labels = selector if plain else selector.get("matchLabels", {})
    if any(labels.get(k) != v for k, v in match_labels.items()):
        return False
    for expr in [] if plain else selector.get("matchExpressions", []):
        value, op, values = labels.get(expr["key"]), expr["operator"], expr.get("values", [])
        if (op == "In" and value not in values) or (op == "NotIn" and value in values):
            return False
        if (op == "Exists" and value is None) or (op == "DoesNotExist" and value is not None):
            return False
    return True


def pod_template(obj):
    return obj.get("spec", {}).get("template", {}) if obj["kind"] in WORKLOAD_KINDS else None


def container_ports(template):
    spec = template.get("spec", {})
    ports = {}
    for c in spec.get("containers", []):
        for p in c.get("ports", []):
            if "name" in p:
                ports[p["name"]] = p["containerPort"]
            ports[str(p["containerPort"])] = p["containerPort"]
    return ports


def config_keys(path, struct):
    """The fields of a daemon's config struct (serde keys), read from its source."""
    text = open(os.path.join(ROOT, path)).read()
    body = re.search(r"pub struct " + struct + r" \{(.*?)\n\}", text, re.S)
    if not body:
        sys.exit(f"{path}: struct {struct} not found (validate.py reads its fields)")
    return set(re.findall(r"^\s*pub (\w+):", body.group(1), re.M))


DAEMON_ENV = {
    "RACEKV_MEMNODE_": ("memnode/src/config.rs", "MemnodeConfig"),
    "RACEKV_COMPUTENODE_": ("computenode/src/config.rs", "ComputenodeConfig"),
}
OTHER_ENV = {"RACEKV_LOG_FORMAT", "RACEKV_LOG"}


def check_env(obj, where, report, keys_cache):
    for c in pod_template(obj).get("spec", {}).get("containers", []):
        for env in c.get("env", []):
            name = env["name"]
            for prefix, (path, struct) in DAEMON_ENV.items():
                if not name.startswith(prefix):
                    continue
                keys = keys_cache.setdefault(prefix, config_keys(path, struct))
                key = name[len(prefix):].lower().split("__")[0]
                base = key[: -len("_file")] if key.endswith("_file") else None
                if key not in keys and base not in keys:
                    report.error(where, f"container {c['name']}: {name} is no setting of {struct} ({path})")
            if name.startswith("RACEKV_") and not any(name.startswith(p) for p in DAEMON_ENV) and name not in OTHER_ENV:
                report.error(where, f"container {c['name']}: unknown variable {name}")


def env_value(template, container_kind, name):
    for c in template.get("spec", {}).get("containers", []):
        for env in c.get("env", []):
            if env["name"] == name:
                return env.get("value")
    return None


def check_host_network(w, spec, labels, where, report):
    """A pod on its host's network resolves cluster names only with ClusterFirstWithHostNet,
    and two of a workload's pods on one host would want the same ports."""
    if spec.get("dnsPolicy") != "ClusterFirstWithHostNet":
        report.error(where, "hostNetwork without dnsPolicy ClusterFirstWithHostNet: cluster DNS names do not resolve")
    if w["kind"] == "DaemonSet" or w["spec"].get("replicas", 1) <= 1:
        return
    required = spec.get("affinity", {}).get("podAntiAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution", [])
    if not any(t.get("topologyKey") == "kubernetes.io/hostname" and matches(t.get("labelSelector"), labels) for t in required):
        report.error(where, "hostNetwork with several replicas and no required one-per-host anti-affinity: two pods on a host want the same ports")


def cross_checks(objs, where_prefix, report):
    by_kind = {}
    seen = set()
    for obj in objs:
        key = (obj.get("apiVersion"), obj.get("kind"), obj["metadata"].get("namespace"), obj["metadata"].get("name"))
        if key in seen:
            report.error(where_prefix, f"{ident(obj)} defined twice")
        seen.add(key)
        by_kind.setdefault(obj["kind"], []).append(obj)
    workloads = [o for o in objs if o["kind"] in WORKLOAD_KINDS]
    services = by_kind.get("Service", [])
    secrets = {o["metadata"]["name"]: set(o.get("data", {})) | set(o.get("stringData", {})) for o in by_kind.get("Secret", [])}
    configmaps = {o["metadata"]["name"] for o in by_kind.get("ConfigMap", [])}
    keys_cache = {}

    def where(obj):
        return f"{where_prefix} {ident(obj)}"

    def selected(selector, namespace):
        return [w for w in workloads if w["metadata"].get("namespace") == namespace
                and matches(selector, pod_template(w).get("metadata", {}).get("labels", {}))]

    for w in workloads:
        template = pod_template(w)
        labels = template.get("metadata", {}).get("labels", {})
        if not matches(w["spec"].get("selector"), labels):
            report.error(where(w), "spec.selector does not match the pod template's labels")
        spec = template.get("spec", {})
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        claims = {t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])}
        for c in spec.get("initContainers", []) + spec.get("containers", []):
            for m in c.get("volumeMounts", []):
                if m["name"] not in volumes and m["name"] not in claims:
                    report.error(where(w), f"container {c['name']} mounts {m['name']}, which is no volume")
            for port in ("readinessProbe", "livenessProbe", "startupProbe"):
                probe_port = c.get(port, {}).get("httpGet", {}).get("port")
                if probe_port is not None and str(probe_port) not in container_ports({"spec": {"containers": [c]}}):
                    report.error(where(w), f"container {c['name']}: {port} port {probe_port} is not a port of the container")
            if "resources" not in c or "requests" not in c["resources"]:
                report.error(where(w), f"container {c['name']} has no resource requests")
        for v in volumes.values():
            if "secret" in v:
                name = v["secret"]["secretName"]
                have = secrets.get(name, EXTERNAL_SECRETS.get(name))
                if have is None:
                    report.error(where(w), f"volume {v['name']}: Secret {name} is neither rendered nor documented")
                for item in v["secret"].get("items", []):
                    if have is not None and item["key"] not in have:
                        report.error(where(w), f"volume {v['name']}: Secret {name} has no key {item['key']}")
            if "configMap" in v and v["configMap"]["name"] not in configmaps:
                report.error(where(w), f"volume {v['name']}: ConfigMap {v['configMap']['name']} is not rendered")
        check_env(w, where(w), report, keys_cache)
        if spec.get("hostNetwork"):
            check_host_network(w, spec, labels, where(w), report)

    for s in services:
        sel = s["spec"].get("selector")
        targets = selected(sel, s["metadata"].get("namespace"))
        if not targets:
            report.error(where(s), f"selector {sel} selects no pods")
        for p in s["spec"].get("ports", []):
            tp = str(p.get("targetPort", p["port"]))
            for t in targets:
                if tp not in container_ports(pod_template(t)):
                    report.error(where(s), f"port {p.get('name')}: targetPort {tp} is not a port of {ident(t)}")

    for pdb in by_kind.get("PodDisruptionBudget", []):
        if not selected(pdb["spec"].get("selector"), pdb["metadata"].get("namespace")):
            report.error(where(pdb), "selects no pods")

    for np in by_kind.get("NetworkPolicy", []):
        pods = selected(np["spec"]["podSelector"], np["metadata"].get("namespace"))
        if np["spec"]["podSelector"] and not pods:
            report.error(where(np), "podSelector selects no pods")
        for rule in np["spec"].get("ingress", []):
            for p in rule.get("ports", []):
                port = str(p.get("port"))
                if pods and not any(port in container_ports(pod_template(t)) for t in pods):
                    report.error(where(np), f"port {port} is a port of none of the pods it selects")

    for sm in by_kind.get("ServiceMonitor", []):
        svcs = [s for s in services if s["metadata"].get("namespace") == sm["metadata"].get("namespace")
                and matches(sm["spec"]["selector"], s["metadata"].get("labels", {}))]
        if not svcs:
            report.error(where(sm), "selects no Service")
        job_label = sm["spec"].get("jobLabel")
        for s in svcs:
            names = {p.get("name") for p in s["spec"].get("ports", [])}
            for e in sm["spec"].get("endpoints", []):
                if e.get("port") and e["port"] not in names:
                    report.error(where(sm), f"endpoint port {e['port']} is no port of {ident(s)}")
            if job_label and job_label not in s["metadata"].get("labels", {}):
                report.error(where(sm), f"{ident(s)} has no label {job_label} (jobLabel)")

    for so in by_kind.get("ScaledObject", []):
        ref = so["spec"]["scaleTargetRef"]
        kind = ref.get("kind", "Deployment")
        target = [w for w in workloads if w["kind"] == kind and w["metadata"]["name"] == ref["name"]]
        if not target:
            report.error(where(so), f"scaleTargetRef {kind}/{ref['name']} is not rendered")
        elif "replicas" in target[0]["spec"]:
            report.error(where(so), f"{kind}/{ref['name']} sets replicas: re-applying would fight KEDA")
        lo, hi = so["spec"].get("minReplicaCount", 0), so["spec"].get("maxReplicaCount", 100)
        if lo > hi:
            report.error(where(so), f"minReplicaCount {lo} > maxReplicaCount {hi}")

    # The computenodes must name every memnode, each on the port it listens on.
    memnodes = [w for w in workloads if w["kind"] == "StatefulSet"
                and env_value(pod_template(w), "memnode", "RACEKV_MEMNODE_REGION_BYTES") is not None]
    expected = set()
    for m in memnodes:
        tmpl = pod_template(m)
        verbs = env_value(tmpl, "memnode", "RACEKV_MEMNODE_LISTEN_VERBS")
        for i in range(m["spec"].get("replicas", 1)):
            host = f"{m['metadata']['name']}-{i}.{m['spec']['serviceName']}"
            expected.add(f"verbs:{host}:{verbs.rsplit(':', 1)[1]}" if verbs else
                         f"tcp:{host}:{env_value(tmpl, 'memnode', 'RACEKV_MEMNODE_LISTEN_TCP').rsplit(':', 1)[1]}")
    for w in workloads:
        listed = env_value(pod_template(w), "computenode", "RACEKV_COMPUTENODE_MEMNODES")
        if listed is None:
            continue
        got = set(listed.split(","))
        if got != expected:
            report.error(where(w), f"RACEKV_COMPUTENODE_MEMNODES is {sorted(got)}, the memnodes are {sorted(expected)}")

    # The cluster's init Job waits for as many memnodes as the StatefulSets run (more: it
    # never writes the map; fewer: the map leaves memnodes out).
    running = sum(m["spec"].get("replicas", 1) for m in memnodes)
    for job in by_kind.get("Job", []):
        for c in job["spec"].get("template", {}).get("spec", {}).get("containers", []):
            args = [str(a) for a in c.get("command", []) + c.get("args", [])]
            if memnodes and "--wait-memnodes" in args:
                at = args.index("--wait-memnodes")
                wanted = args[at + 1] if at + 1 < len(args) else "(nothing)"
                if wanted != str(running):
                    report.error(where(job), f"--wait-memnodes {wanted}, and the memnode StatefulSets run {running}")

    for rule in by_kind.get("PrometheusRule", []):
        with open(os.path.join(ROOT, "ops", "prometheus", "racekv-rules.yml")) as f:
            want = yaml.safe_load(f)["groups"]
        if rule["spec"].get("groups") != want:
            report.error(where(rule), "groups differ from ops/prometheus/racekv-rules.yml: run deploy/kubernetes/gen-prometheusrule.py")


def validate_objects(objs, name, crds, used, registry, k8s_version, report):
    for obj in objs:
        validate_schema(obj, f"{name} {ident(obj)}", crds, used, registry, k8s_version, report)
    try:
        cross_checks(objs, name, report)
    except (KeyError, TypeError, AttributeError, ValueError, IndexError) as e:
        # Malformed objects the schemas have reported already.
        report.error(name, f"cross-checks stopped on malformed input: {e!r}")


# Mistakes the checks must catch: (what, mutation of one overlay's objects, expected text).
def _get(objs, kind, name=None):
    return next(o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name))


def _host_network_spec(objs, kind):
    return next(o for o in objs if o["kind"] == kind and o["spec"]["template"]["spec"].get("hostNetwork"))["spec"]["template"]["spec"]


def _container(objs, kind):
    return _get(objs, kind)["spec"]["template"]["spec"]["containers"][0]


MUTATIONS = [
    ("a misspelt Kubernetes field", lambda o: _container(o, "StatefulSet").update(imagePullPolicyy="Always"), "imagePullPolicyy"),
    ("a wrong type", lambda o: _get(o, "StatefulSet")["spec"].update(replicas="3"), "replicas"),
    ("a misspelt ScaledObject field", lambda o: _get(o, "ScaledObject")["spec"].update(maxReplicas=3), "maxReplicas"),
    ("a trigger without metadata", lambda o: _get(o, "ScaledObject")["spec"]["triggers"][0].pop("metadata"), "metadata"),
    ("a bad HPA behavior", lambda o: _get(o, "ScaledObject")["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"].update(stabilisation=1), "stabilisation"),
    ("a ServiceMonitor without selector", lambda o: _get(o, "ServiceMonitor")["spec"].pop("selector"), "selector"),
    ("a bad rule duration", lambda o: _get(o, "PrometheusRule")["spec"]["groups"][0]["rules"][0].update({"for": "1 minute"}), "1 minute"),
    ("a bad label on a custom resource", lambda o: _get(o, "PrometheusRule")["metadata"].update(labels={"a": 1}), "metadata.labels"),
    ("a rule edited here only", lambda o: _get(o, "PrometheusRule")["spec"]["groups"][0]["rules"][0].update(expr="up == 0"), "racekv-rules.yml"),
    ("a memnode left out of the list", lambda o: _get(o, "StatefulSet", "racekv-memnode")["spec"].update(replicas=2), "RACEKV_COMPUTENODE_MEMNODES"),
    ("a setting the daemon lacks", lambda o: _container(o, "DaemonSet")["env"].append({"name": "RACEKV_COMPUTENODE_REDIS_PORT", "value": "1"}), "REDIS_PORT"),
    ("a Service port the pods lack", lambda o: _get(o, "Service", "racekv-remote")["spec"]["ports"][0].update(targetPort="remotes"), "remotes"),
    ("a probe on a missing port", lambda o: _container(o, "Deployment")["readinessProbe"]["httpGet"].update(port="health"), "readinessProbe"),
    ("replicas KEDA owns", lambda o: _get(o, "Deployment")["spec"].update(replicas=3), "fight KEDA"),
    ("a ServiceMonitor port the Service lacks", lambda o: _get(o, "ServiceMonitor")["spec"]["endpoints"][0].update(port="metric"), "metric"),
    ("a missing Secret key", lambda o: _get(o, "DaemonSet")["spec"]["template"]["spec"]["volumes"][1]["secret"]["items"][0].update(key="tokens"), "tokens"),
    ("an init Job waiting for too few memnodes", lambda o: _get(o, "Job")["spec"]["template"]["spec"]["containers"][0]["args"].__setitem__(
        _get(o, "Job")["spec"]["template"]["spec"]["containers"][0]["args"].index("--wait-memnodes") + 1, "2"), "--wait-memnodes 2"),
    ("a host-network pod without cluster DNS", lambda o: _host_network_spec(o, "DaemonSet").pop("dnsPolicy"), "ClusterFirstWithHostNet"),
    ("host-network memnodes allowed to share a host", lambda o: _host_network_spec(o, "StatefulSet").pop("affinity"), "one-per-host"),
]


def self_test(paths, crds, registry, k8s_version):
    """Each mutation of a valid rendering must be reported: the checks are not vacuous. A
    mutation goes to the first rendering that has the objects it changes (the dev one has
    no cluster init Job, for instance); one that fits none fails too."""
    renderings = []
    for path in paths:
        with open(path) as f:
            renderings.append([d for d in yaml.safe_load_all(f) if d])
    failed = 0
    for what, mutate, expected in MUTATIONS:
        for clean in renderings:
            objs = copy.deepcopy(clean)
            try:
                mutate(objs)
            except StopIteration:
                continue  # this rendering lacks the object: try the next
            report = Report()
            validate_objects(objs, "self-test", crds, {}, registry, k8s_version, report)
            if not any(expected in e for e in report.errors):
                print(f"SELF-TEST FAILED: {what} was not reported (errors: {report.errors})")
                failed += 1
            break
        else:
            print(f"SELF-TEST FAILED: {what}: no rendering has the objects it changes")
            failed += 1
    print(f"  self-test: {len(MUTATIONS) - failed} of {len(MUTATIONS)} planted mistakes reported")
    return failed


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kubernetes-version", required=True)
    parser.add_argument("--minimal-crds", action="store_true",
                        help="ignore crds/*.yaml: check the hand-written stand-ins instead")
    parser.add_argument("--self-test", action="store_true",
                        help="also plant known mistakes in the renderings and expect each reported")
    parser.add_argument("rendered", nargs="+")
    args = parser.parse_args()
    report = Report()
    crds = load_crds(report, args.kubernetes_version, args.minimal_crds)
    registry = k8s_registry(args.kubernetes_version)
    used = {}
    for path in args.rendered:
        name = os.path.splitext(os.path.basename(path))[0]
        with open(path) as f:
            objs = [d for d in yaml.safe_load_all(f) if d]
        before = len(report.errors)
        validate_objects(objs, name, crds, used, registry, args.kubernetes_version, report)
        kinds = {}
        for o in objs:
            kinds[o["kind"]] = kinds.get(o["kind"], 0) + 1
        status = "ok" if len(report.errors) == before else f"{len(report.errors) - before} error(s)"
        print(f"  {name}: {len(objs)} objects ({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))}): {status}")
    print("  schemas used:")
    for kind, source in sorted(used.items()):
        print(f"    {kind}: {source}")
    for e in report.errors:
        print(f"ERROR {e}")
    failed = self_test(args.rendered, crds, registry, args.kubernetes_version) if args.self_test else 0
    return 1 if report.errors or failed else 0


if __name__ == "__main__":
    sys.exit(main())
