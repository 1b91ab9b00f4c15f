#!/usr/bin/env bash
# Self-signed serving certificate for the webhook (when cert-manager is not used):
# creates a CA and a certificate for the webhook Service, stores them in the
# gpu-coloc-webhook-tls Secret, and writes the CA into both webhook configurations.
# Re-run it to rotate (the webhook reloads the files without a restart).
# usage: self-signed-webhook-cert.sh [namespace] [release-name]
set -euo pipefail
ns=${1:-gpu-coloc}; name=${2:-gpu-coloc}
svc="$name-webhook"
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=gpu-coloc-webhook-ca" \
  -keyout "$dir/ca.key" -out "$dir/ca.crt" 2>/dev/null
openssl req -newkey rsa:2048 -nodes -subj "/CN=$svc.$ns.svc" -keyout "$dir/tls.key" -out "$dir/tls.csr" 2>/dev/null
printf 'subjectAltName=DNS:%s,DNS:%s.%s,DNS:%s.%s.svc,DNS:%s.%s.svc.cluster.local\n' \
  "$svc" "$svc" "$ns" "$svc" "$ns" "$svc" "$ns" > "$dir/ext"
openssl x509 -req -in "$dir/tls.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" -CAcreateserial \
  -days 825 -extfile "$dir/ext" -out "$dir/tls.crt" 2>/dev/null
kubectl -n "$ns" create secret tls "$svc-tls" --cert="$dir/tls.crt" --key="$dir/tls.key" \
  --dry-run=client -o yaml | kubectl apply -f -
ca=$(base64 -w0 < "$dir/ca.crt")
for kind in mutatingwebhookconfiguration validatingwebhookconfiguration; do
  n=$(kubectl get "$kind" "$svc" -o jsonpath='{.webhooks[*].name}' | wc -w)
  patch=$(for i in $(seq 0 $((n - 1))); do printf '{"op":"add","path":"/webhooks/%d/clientConfig/caBundle","value":"%s"},' "$i" "$ca"; done)
  kubectl patch "$kind" "$svc" --type=json -p "[${patch%,}]"
done
echo "webhook certificate installed in secret $ns/$svc-tls; caBundle set on $n webhook(s) per configuration"
