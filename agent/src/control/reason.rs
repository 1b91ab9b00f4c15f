//! Bounded reasons the controller gives, as enums: why offline work failed open, why a
//! doorbell reading counts for nothing. Strings only at the metric and log boundary.

/// Why offline work was resumed because something failed (`coloc_fail_open_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailWhy {
    /// A GPU's NVML calls kept failing.
    Nvml,
    /// An NVML call did not return.
    NvmlHung,
    /// The record could not be written.
    Record,
    /// A suspension failed or was not confirmed.
    Actuation,
    /// The loop unwound from a panic.
    Panic,
}

impl FailWhy {
    /// Metric and event label.
    pub fn as_str(self) -> &'static str {
        match self {
            FailWhy::Nvml => "nvml",
            FailWhy::NvmlHung => "nvml_hung",
            FailWhy::Record => "record",
            FailWhy::Actuation => "actuation",
            FailWhy::Panic => "panic",
        }
    }
}

/// Why a doorbell reading was not attributed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reject {
    /// The reading names a GPU this node does not have.
    UnknownGpu,
    /// No known process owns the page.
    UnknownOwner,
    /// Its owner is not online.
    NotOnline,
    /// The page's file owner is not the process's user.
    UidMismatch,
    /// Its owner does not use the GPU the reading names.
    NotOnGpu,
    /// Its owner's claims kept the GPU busy while NVML never showed the owner at work.
    Uncorroborated,
}

impl Reject {
    /// Every reason (counted from 0 at start).
    pub const ALL: [Reject; 6] = [
        Reject::UnknownGpu,
        Reject::UnknownOwner,
        Reject::NotOnline,
        Reject::UidMismatch,
        Reject::NotOnGpu,
        Reject::Uncorroborated,
    ];

    /// Metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Reject::UnknownGpu => "unknown_gpu",
            Reject::UnknownOwner => "unknown_owner",
            Reject::NotOnline => "not_online",
            Reject::UidMismatch => "uid_mismatch",
            Reject::NotOnGpu => "not_on_gpu",
            Reject::Uncorroborated => "uncorroborated",
        }
    }
}
