//! AdmissionReview in, AdmissionReview out. Pure function of the request bytes, so that
//! the router, the fuzz test and the benchmark all drive the same code.
//!
//! CREATE goes to [`translate`]; UPDATE to [`review_update`], which checks the update
//! against what the pod asked for at creation and patches metadata only.
//!
//! Bad input never panics: unparsable bodies and reviews without a request are HTTP 400;
//! objects that are not Pods are allowed untouched; pods that cannot be read are denied
//! with a message.

use crate::translate::{review_update, translate, Backend, Settings};
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use kube::core::DynamicObject;
use serde_json::Value;

/// Which endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// `/mutate`: validate and return a patch.
    Mutate,
    /// `/validate`: validate only.
    Validate,
    /// `/unsupported-backend`: the namespace's `gpu-coloc.dev/backend` label names no
    /// backend; pods that ask for mGPU are refused at CREATE, others allowed.
    Unsupported,
    /// `/inject`: the CUDA shim into GPU pods at CREATE ([`crate::inject`]); never denies.
    Inject,
    /// `/validate-mounts`: what a pod may mount of the node's gpu-coloc directories
    /// ([`crate::mounts`]), at CREATE and when ephemeral containers are added; validates
    /// only.
    Mounts,
}

impl Mode {
    /// Metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Mutate => "mutate",
            Mode::Validate => "validate",
            Mode::Unsupported => "unsupported_backend",
            Mode::Inject => "inject",
            Mode::Mounts => "validate_mounts",
        }
    }
}

/// The result of one review.
#[derive(Debug)]
pub struct Reviewed {
    /// HTTP status.
    pub status: u16,
    /// Response body (an AdmissionReview, or a plain error message for 400).
    pub body: Vec<u8>,
    /// Bounded metric label: allowed, patched, denied, invalid.
    pub result: &'static str,
    /// Bounded denial reason, when denied.
    pub reason: Option<&'static str>,
}

fn bad_request(msg: String) -> Reviewed {
    Reviewed {
        status: 400,
        body: msg.into_bytes(),
        result: "invalid",
        reason: None,
    }
}

/// Handles one AdmissionReview body.
pub fn review(body: &[u8], mode: Mode, backend: Option<Backend>, settings: &Settings) -> Reviewed {
    // The objects are read as sent (JSON), so that a patch is made against exactly what
    // the API server will apply it to; the typed view validates the envelope.
    let raw: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => return bad_request(format!("not an admission.k8s.io/v1 AdmissionReview: {e}")),
    };
    let review: AdmissionReview<DynamicObject> = match serde::Deserialize::deserialize(&raw) {
        Ok(r) => r,
        Err(e) => return bad_request(format!("not an admission.k8s.io/v1 AdmissionReview: {e}")),
    };
    if review.types.api_version != "admission.k8s.io/v1" || review.types.kind != "AdmissionReview" {
        return bad_request(format!(
            "expected admission.k8s.io/v1 AdmissionReview, got {}/{}",
            review.types.api_version, review.types.kind
        ));
    }
    let req: AdmissionRequest<DynamicObject> = match review.try_into() {
        Ok(r) => r,
        Err(e) => return bad_request(format!("AdmissionReview without a request: {e}")),
    };
    let resp = AdmissionResponse::from(&req);
    let pod_kind = req.kind.group.is_empty() && req.kind.kind == "Pod";
    let is_pod = pod_kind && req.sub_resource.is_none();
    let acts = matches!(req.operation, Operation::Create | Operation::Update);
    // What the pod mounts of the node's gpu-coloc directories (`/validate-mounts`, and
    // `/validate` at CREATE): denied before anything else.
    let mounts = match (mode, &req.object) {
        (Mode::Mounts | Mode::Validate, Some(_)) if pod_kind => {
            let pod = &raw["request"]["object"];
            let shim = settings.shim.clone().unwrap_or_default();
            let extra = &settings.protected_host_paths;
            match (&req.operation, req.sub_resource.as_deref()) {
                (Operation::Create, None) => crate::mounts::check_pod(pod, &shim, extra),
                (Operation::Update, Some("ephemeralcontainers")) if mode == Mode::Mounts => {
                    crate::mounts::check_ephemeral(pod, &shim, extra)
                }
                _ => Ok(()),
            }
        }
        _ => Ok(()),
    };
    let (resp, result, reason) = match (&req.object, is_pod && acts) {
        _ if mounts.is_err() || mode == Mode::Mounts => match mounts {
            Err(d) => {
                let mut r = resp.deny(&d.message);
                r.result.code = 403;
                r.result.reason = "Forbidden".into();
                (r, "denied", Some(d.reason))
            }
            Ok(()) => (resp, "allowed", None),
        },
        (Some(_), true) if mode == Mode::Inject => {
            let pod = &raw["request"]["object"];
            // Only at CREATE: a pod's containers, env and volumes cannot change later.
            let inj = match (&settings.shim, req.operation) {
                (Some(shim), Operation::Create) => {
                    crate::inject::inject(pod, shim, &settings.classes.mapping())
                }
                _ => crate::inject::Injection::default(),
            };
            let mut resp = resp;
            if !inj.warnings.is_empty() {
                resp.warnings = Some(inj.warnings);
            }
            if inj.ops.is_empty() {
                (resp, "allowed", None)
            } else {
                match serde_json::from_value::<json_patch::Patch>(Value::Array(inj.ops))
                    .map_err(|e| e.to_string())
                    .and_then(|p| resp.clone().with_patch(p).map_err(|e| e.to_string()))
                {
                    Ok(r) => (r, "patched", None),
                    // Never deny for the shim: the pod runs without it.
                    Err(e) => {
                        tracing::error!(error = %e, "Could not build the shim injection patch; pod admitted without it");
                        (resp, "allowed", None)
                    }
                }
            }
        }
        (Some(_), true) => {
            let pod = &raw["request"]["object"];
            let backend = backend.unwrap_or(settings.backend);
            let outcome = if mode == Mode::Unsupported {
                // Only CREATE: pods admitted before the label changed stay updatable.
                if req.operation == Operation::Create && crate::translate::asks_for_mgpu(pod) {
                    Err(crate::translate::Denial {
                        message: format!("this pod asks for mGPU ({}), but its namespace's label {} names no backend this webhook knows; allowed: {} (or remove the label for the default backend)",
                            crate::translate::MGPU_RESOURCE_PREFIX,
                            crate::translate::BACKEND_LABEL,
                            crate::translate::BACKEND_NAMES.join(", ")),
                        reason: "backend_unsupported",
                    })
                } else {
                    Ok(vec![])
                }
            } else if req.operation == Operation::Update {
                // Checked against what the pod asked for at CREATE; metadata-only patch.
                review_update(&raw["request"]["oldObject"], pod)
            } else {
                translate(pod, backend, settings)
            };
            match outcome {
                Ok(ops) if ops.is_empty() || mode == Mode::Validate => (resp, "allowed", None),
                Ok(ops) => match serde_json::from_value::<json_patch::Patch>(Value::Array(ops))
                    .map_err(|e| e.to_string())
                    .and_then(|p| resp.clone().with_patch(p).map_err(|e| e.to_string()))
                {
                    Ok(r) => (r, "patched", None),
                    Err(e) => (
                        resp.deny(format!("gpu-coloc could not build a patch: {e}")),
                        "denied",
                        Some("internal"),
                    ),
                },
                Err(d) => {
                    let mut r = resp.deny(&d.message);
                    r.result.code = 403;
                    r.result.reason = "Forbidden".into();
                    (r, "denied", Some(d.reason))
                }
            }
        }
        _ => (resp, "allowed", None),
    };
    match serde_json::to_value(resp.into_review())
        .map(base64_patch)
        .and_then(|v| serde_json::to_vec(&v))
    {
        Ok(body) => Reviewed {
            status: 200,
            body,
            result,
            reason,
        },
        Err(e) => bad_request(format!("cannot serialise response: {e}")),
    }
}

/// kube-core serialises `response.patch` (a Go `[]byte`) as an array of numbers; the API
/// documents it as a base64 string, which is what every API server version accepts.
fn base64_patch(mut v: Value) -> Value {
    use base64::Engine;
    if let Some(arr) = v.pointer("/response/patch").and_then(Value::as_array) {
        let bytes: Vec<u8> = arr
            .iter()
            .filter_map(Value::as_u64)
            .map(|b| b as u8)
            .collect();
        v["response"]["patch"] =
            Value::String(base64::engine::general_purpose::STANDARD.encode(bytes));
    }
    v
}
