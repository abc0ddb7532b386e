#!/usr/bin/env bash
# Renders every overlay of deploy/kubernetes and validates what comes out, offline:
#
#   deploy/kubernetes/validate.sh
#
# 1. the PrometheusRule is current with ops/prometheus/racekv-rules.yml (gen-prometheusrule.py);
# 2. `kubectl kustomize` (kustomize built into kubectl) renders overlays/{dev,production,rdma,host-network}
#    into deploy/kubernetes/rendered/ (gitignored);
# 3. validate.py checks every object, strictly: Kubernetes kinds against kubernetes-validate's
#    schemas for Kubernetes $K8S_VERSION, KEDA and Prometheus Operator kinds against their
#    CRDs (crds/*.yaml), and what spans objects (selectors, ports, the memnode list, the
#    daemons' settings); a self-test plants known mistakes and expects each reported;
# 4. the same again against the hand-written stand-in CRDs (schemas/minimal-crds.yaml), so
#    they stay usable where crds/ is absent.
# Python packages go into deploy/kubernetes/.venv (requirements.txt; reused when present).
# Exits non-zero on any failure.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here"
K8S_VERSION=${K8S_VERSION:-1.30.0}
overlays=(dev production rdma host-network)

venv=$here/.venv
if ! "$venv/bin/python" -c "import kubernetes_validate, jsonschema, yaml" 2>/dev/null \
    || ! cmp -s <("$venv/bin/pip" freeze 2>/dev/null | sort) <(grep -v '^#' requirements.txt | sort); then
    echo "validate: installing requirements.txt into $venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check -r requirements.txt
fi

if ! command -v kubectl > /dev/null || ! kubectl kustomize --help > /dev/null 2>&1; then
    echo "validate: kubectl (with its built-in kustomize) is needed to render the overlays" >&2
    echo "validate: it comes with the machine image (Debian package kubectl); see README.md" >&2
    exit 1
fi
kustomize_version=$(kubectl version --client 2>/dev/null | sed -n 's/^Kustomize Version: //p')
echo "validate: kubectl kustomize (kustomize ${kustomize_version:-unknown}), kubernetes-validate $("$venv/bin/python" -c 'import kubernetes_validate; print(kubernetes_validate.__version__)') for Kubernetes $K8S_VERSION"

failed=0
"$venv/bin/python" gen-prometheusrule.py --check || failed=1

mkdir -p rendered
rendered=()
for o in "${overlays[@]}"; do
    if kubectl kustomize "overlays/$o" > "rendered/$o.yaml"; then
        rendered+=("rendered/$o.yaml")
    else
        echo "validate: overlays/$o does not render" >&2
        failed=1
    fi
done

if [[ ${#rendered[@]} -gt 0 ]]; then
    echo "validate: checking ${rendered[*]}"
    "$venv/bin/python" validate.py --kubernetes-version "$K8S_VERSION" --self-test "${rendered[@]}" || failed=1
    if compgen -G "crds/*.yaml" > /dev/null; then
        echo "validate: again against the hand-written stand-in CRDs"
        "$venv/bin/python" validate.py --kubernetes-version "$K8S_VERSION" --minimal-crds "${rendered[@]}" > rendered/minimal-crds.log \
            && echo "  ok" || { cat rendered/minimal-crds.log; failed=1; }
    fi
fi

if [[ $failed -ne 0 ]]; then
    echo "validate: FAILED"
    exit 1
fi
echo "validate: ${#rendered[@]} overlays rendered and valid"
