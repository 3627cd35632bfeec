#!/bin/sh
# Writes the files kustomization.yaml's secretGenerator reads, with fresh random values,
# readable by you only; keeps any that exist. Run once, before the first `kubectl apply -k`:
#
#   sh deploy/kubernetes/secrets/generate.sh
#
#   api-keys         the API keys clients send (one a line; add your own)
#   metrics-key      the key Prometheus sends to the API's /metrics
#   nats-<user>      the password of each NATS user (nats/values.yaml): admin, api, prefill, decode
#
# These files are ignored by git (.gitignore beside them). Keep them elsewhere too: the
# NATS users and the API keys in your cluster are these.
set -eu
cd "$(dirname "$0")"
umask 077
random() { od -An -N24 -tx1 /dev/urandom | tr -d ' \n'; }
for name in api-keys metrics-key nats-admin nats-api nats-prefill nats-decode; do
    if [ ! -s "$name" ]; then
        random > "$name"
        echo "wrote $(pwd)/$name"
    fi
done
