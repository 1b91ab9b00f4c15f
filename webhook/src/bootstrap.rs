//! `coloc-webhook bootstrap-cert`: the chart's serving certificate without cert-manager.
//!
//! Run by two Helm hook Jobs (the webhook's own image, each with its own service account
//! and the narrow rights below). It talks to the API server only; the serving webhook
//! never does.
//!
//! ```text
//!  pre-install/pre-upgrade (secret only: no configuration named)
//!  Secret <secret> (kubernetes.io/tls) ── missing, unreadable, for other names, or
//!        │                                 expiring within --renew-before-days
//!        │                                 ─► new CA + serving certificate, written
//!        ▼
//!  post-install/post-upgrade (--patch-only: the Secret is read, never written)
//!  ca.crt ─► caBundle of every webhook in the named Mutating/ValidatingWebhookConfigurations
//! ```
//!
//! Why two steps: the webhook's pods mount the Secret, so it must exist before Helm waits
//! for them (`helm install --wait`), i.e. before the release's objects; the
//! configurations whose `caBundle` is set are release objects, so they exist only after.
//! Both steps in one run (configurations named, no `--patch-only`) is the plain-manifest
//! form.
//!
//! A valid certificate is kept, so `helm upgrade` does not rotate it; the webhook's pods
//! re-read the mounted files when they change. Rights needed: `get, create, update` on
//! the Secret (namespace) for the first step; `get` on the Secret and `get, patch` on the
//! two configurations (cluster) for the second.

use anyhow::{bail, Context, Result};
use base64::Engine;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::ByteString;
use kube::api::{Api, Patch, PatchParams, PostParams};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use std::collections::BTreeMap;

/// Annotation on the Secret: when its serving certificate expires (Unix seconds).
pub const NOT_AFTER_ANNOTATION: &str = "gpu-coloc.dev/not-after";
/// Annotation on the Secret: the DNS names its serving certificate is for (comma-separated).
pub const DNS_NAMES_ANNOTATION: &str = "gpu-coloc.dev/dns-names";

/// What to bootstrap.
#[derive(Debug, Clone)]
pub struct Target {
    /// Namespace of the Service and the Secret.
    pub namespace: String,
    /// The webhook's Service: the certificate is for its cluster DNS names.
    pub service: String,
    /// The TLS Secret the webhook's pods mount.
    pub secret: String,
    /// MutatingWebhookConfigurations whose webhooks get the CA bundle.
    pub mutating: Vec<String>,
    /// ValidatingWebhookConfigurations whose webhooks get the CA bundle.
    pub validating: Vec<String>,
    /// Validity of a new certificate, days.
    pub validity_days: u64,
    /// A certificate with less than this left is replaced, days.
    pub renew_before_days: u64,
    /// What to do.
    pub mode: Mode,
}

/// Which of the two steps to take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Make sure the Secret holds a valid certificate; then set `caBundle` on the named
    /// configurations, if any are named (none: the Secret only, e.g. before they exist).
    Secret,
    /// Only set `caBundle` from the Secret's `ca.crt` (which must exist and be valid);
    /// the Secret is never written.
    PatchOnly,
}

impl Target {
    /// The Service's names inside the cluster.
    pub fn dns_names(&self) -> Vec<String> {
        let (s, n) = (&self.service, &self.namespace);
        vec![
            format!("{s}.{n}.svc"),
            format!("{s}.{n}.svc.cluster.local"),
            format!("{s}.{n}"),
            s.clone(),
        ]
    }
}

/// What happened to the Secret.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SecretOutcome {
    /// There was none: created.
    Created,
    /// There was one, unusable or expiring: replaced.
    Renewed,
    /// There was a valid one: kept.
    Kept,
}

/// The result of one bootstrap.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The Secret (`None` with [`Mode::PatchOnly`]: read, not written).
    pub secret: Option<SecretOutcome>,
    /// Webhooks whose `caBundle` was set.
    pub webhooks_patched: usize,
    /// The CA certificate (PEM) now in the Secret and the configurations.
    pub ca_pem: String,
}

/// The start (00:00 UTC) of the day of a Unix time, as rcgen takes validity bounds.
fn day(unix: u64) -> Result<time::OffsetDateTime> {
    let t = time::OffsetDateTime::from_unix_timestamp(i64::try_from(unix)?)?;
    Ok(t.replace_time(time::Time::MIDNIGHT))
}

/// A new CA and a serving certificate signed by it: (ca.crt, tls.crt, tls.key), PEM.
pub fn issue(
    dns_names: &[String],
    now_unix: u64,
    validity_days: u64,
) -> Result<(String, String, String)> {
    let not_before = day(now_unix.saturating_sub(86_400))?;
    let not_after = day(now_unix + validity_days * 86_400)?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "gpu-coloc webhook CA");
    ca_params.not_before = not_before;
    ca_params.not_after = not_after;
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate()?)?;
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(dns_names.to_vec())?;
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, dns_names[0].clone());
    params.not_before = not_before;
    params.not_after = not_after;
    let cert = params.signed_by(&key, &ca)?;
    Ok((ca.pem(), cert.pem(), key.serialize_pem()))
}

/// Why an existing Secret cannot be kept, or `None` when it can.
fn unusable(s: &Secret, t: &Target, now_unix: u64) -> Option<String> {
    let data = s.data.as_ref();
    for key in ["ca.crt", "tls.crt", "tls.key"] {
        if data.and_then(|d| d.get(key)).is_none_or(|v| v.0.is_empty()) {
            return Some(format!("it has no {key}"));
        }
    }
    let ann = s.metadata.annotations.clone().unwrap_or_default();
    let Some(not_after) = ann
        .get(NOT_AFTER_ANNOTATION)
        .and_then(|v| v.parse::<u64>().ok())
    else {
        return Some(format!("it has no {NOT_AFTER_ANNOTATION} annotation"));
    };
    if ann.get(DNS_NAMES_ANNOTATION) != Some(&t.dns_names().join(",")) {
        return Some(format!(
            "it is for other names ({:?})",
            ann.get(DNS_NAMES_ANNOTATION)
        ));
    }
    if not_after < now_unix + t.renew_before_days * 86_400 {
        return Some(format!(
            "it expires in {} days",
            not_after.saturating_sub(now_unix) / 86_400
        ));
    }
    None
}

fn secret_for(t: &Target, now_unix: u64) -> Result<(Secret, String)> {
    let names = t.dns_names();
    let (ca, crt, key) = issue(&names, now_unix, t.validity_days)?;
    let data: BTreeMap<String, ByteString> =
        [("ca.crt", &ca), ("tls.crt", &crt), ("tls.key", &key)]
            .into_iter()
            .map(|(k, v)| (k.to_string(), ByteString(v.clone().into_bytes())))
            .collect();
    let mut s = Secret {
        type_: Some("kubernetes.io/tls".into()),
        data: Some(data),
        ..Default::default()
    };
    s.metadata.name = Some(t.secret.clone());
    s.metadata.namespace = Some(t.namespace.clone());
    s.metadata.labels = Some(BTreeMap::from([(
        "app.kubernetes.io/managed-by".to_string(),
        "coloc-webhook-bootstrap-cert".to_string(),
    )]));
    s.metadata.annotations = Some(BTreeMap::from([
        (
            NOT_AFTER_ANNOTATION.to_string(),
            (now_unix + t.validity_days * 86_400).to_string(),
        ),
        (DNS_NAMES_ANNOTATION.to_string(), names.join(",")),
    ]));
    Ok((s, ca))
}

/// JSON patch setting `caBundle` on each of `count` webhooks.
fn ca_patch(count: usize, ca_pem: &str) -> Result<json_patch::Patch> {
    let b64 = base64::engine::general_purpose::STANDARD.encode(ca_pem);
    let ops: Vec<serde_json::Value> = (0..count)
        .map(|i| serde_json::json!({"op": "add", "path": format!("/webhooks/{i}/clientConfig/caBundle"), "value": b64}))
        .collect();
    Ok(serde_json::from_value(serde_json::Value::Array(ops))?)
}

/// The CA (PEM) in a Secret that [`unusable`] accepts.
fn ca_of(s: &Secret) -> Result<String> {
    let ca = s
        .data
        .as_ref()
        .and_then(|d| d.get("ca.crt"))
        .map(|v| v.0.clone());
    String::from_utf8(ca.unwrap_or_default()).context("ca.crt in the Secret is not PEM text")
}

/// Makes sure the Secret holds a valid certificate for the Service (creating or replacing
/// it); returns what happened and its CA.
pub async fn ensure_secret(
    client: kube::Client,
    t: &Target,
    now_unix: u64,
) -> Result<(SecretOutcome, String)> {
    let secrets: Api<Secret> = Api::namespaced(client, &t.namespace);
    let existing = secrets
        .get_opt(&t.secret)
        .await
        .with_context(|| format!("reading Secret {}/{}", t.namespace, t.secret))?;
    Ok(match existing {
        Some(s) => match unusable(&s, t, now_unix) {
            None => {
                tracing::info!(secret = %t.secret, "Serving certificate valid: kept");
                (SecretOutcome::Kept, ca_of(&s)?)
            }
            Some(why) => {
                tracing::info!(secret = %t.secret, %why, "Replacing the serving certificate");
                let (mut new, ca) = secret_for(t, now_unix)?;
                new.metadata.resource_version = s.metadata.resource_version.clone();
                secrets
                    .replace(&t.secret, &PostParams::default(), &new)
                    .await
                    .with_context(|| format!("replacing Secret {}/{}", t.namespace, t.secret))?;
                (SecretOutcome::Renewed, ca)
            }
        },
        None => {
            let (new, ca) = secret_for(t, now_unix)?;
            secrets
                .create(&PostParams::default(), &new)
                .await
                .with_context(|| format!("creating Secret {}/{}", t.namespace, t.secret))?;
            tracing::info!(secret = %t.secret, "Serving certificate created");
            (SecretOutcome::Created, ca)
        }
    })
}

/// The CA of the Secret as it is (never written): it must exist and hold a certificate
/// for the Service. One close to expiry is still used (with a warning): renewing is the
/// first step's job.
pub async fn read_ca(client: kube::Client, t: &Target, now_unix: u64) -> Result<String> {
    let secrets: Api<Secret> = Api::namespaced(client, &t.namespace);
    let s = secrets
        .get_opt(&t.secret)
        .await
        .with_context(|| format!("reading Secret {}/{}", t.namespace, t.secret))?
        .with_context(|| {
            format!(
                "Secret {}/{} does not exist: the certificate step (bootstrap-cert without \
                 --patch-only, the chart's pre-install hook) creates it",
                t.namespace, t.secret
            )
        })?;
    match unusable(&s, t, now_unix) {
        None => {}
        Some(why) if why.starts_with("it expires") => {
            tracing::warn!(secret = %t.secret, %why, "Setting the caBundle of a certificate close to expiry (the next upgrade renews it)")
        }
        Some(why) => bail!(
            "Secret {}/{} cannot be used: {why}; the certificate step (bootstrap-cert without \
             --patch-only) replaces it",
            t.namespace,
            t.secret
        ),
    }
    ca_of(&s)
}

/// Sets `caBundle` to `ca_pem` on every webhook of the named configurations; returns how
/// many webhooks were patched.
pub async fn patch_ca_bundles(client: kube::Client, t: &Target, ca_pem: &str) -> Result<usize> {
    let mut patched = 0;
    let pp = PatchParams::default();
    for name in &t.mutating {
        let api: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
        let cfg = api
            .get(name)
            .await
            .with_context(|| format!("reading MutatingWebhookConfiguration {name}"))?;
        let n = cfg.webhooks.as_ref().map_or(0, Vec::len);
        api.patch(name, &pp, &Patch::Json::<()>(ca_patch(n, ca_pem)?))
            .await
            .with_context(|| format!("patching MutatingWebhookConfiguration {name}"))?;
        patched += n;
    }
    for name in &t.validating {
        let api: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
        let cfg = api
            .get(name)
            .await
            .with_context(|| format!("reading ValidatingWebhookConfiguration {name}"))?;
        let n = cfg.webhooks.as_ref().map_or(0, Vec::len);
        api.patch(name, &pp, &Patch::Json::<()>(ca_patch(n, ca_pem)?))
            .await
            .with_context(|| format!("patching ValidatingWebhookConfiguration {name}"))?;
        patched += n;
    }
    if patched > 0 || !(t.mutating.is_empty() && t.validating.is_empty()) {
        tracing::info!(webhooks = patched, "CA bundle set");
    }
    Ok(patched)
}

/// One run of `bootstrap-cert` ([`Mode`]).
pub async fn bootstrap(client: kube::Client, t: &Target, now_unix: u64) -> Result<Outcome> {
    let named = !(t.mutating.is_empty() && t.validating.is_empty());
    let (secret, ca_pem) = match t.mode {
        Mode::PatchOnly => {
            if !named {
                bail!("--patch-only sets caBundle: name the configurations with --mutating-config and/or --validating-config");
            }
            (None, read_ca(client.clone(), t, now_unix).await?)
        }
        Mode::Secret => {
            let (o, ca) = ensure_secret(client.clone(), t, now_unix).await?;
            (Some(o), ca)
        }
    };
    let webhooks_patched = patch_ca_bundles(client, t, &ca_pem).await?;
    Ok(Outcome {
        secret,
        webhooks_patched,
        ca_pem,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validity_days() {
        let ymd = |unix| {
            let d = day(unix).unwrap();
            (d.year(), u8::from(d.month()), d.day(), d.hour())
        };
        assert_eq!(ymd(0), (1970, 1, 1, 0));
        // 2024-02-29 12:00 UTC (a leap day) and 2026-12-31.
        assert_eq!(ymd(1_709_208_000), (2024, 2, 29, 0));
        assert_eq!(ymd(1_798_675_200), (2026, 12, 31, 0));
    }
}
