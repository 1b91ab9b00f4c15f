//! The dry-run actuator: decides nothing differently, logs what it would do, touches
//! nothing. `--dry-run` swaps it in for the host's actuator (and keeps the record in
//! memory), so the loop has no dry-run branches of its own.

use super::{Actuator, Op, Progress, Target};
use std::time::Duration;
use tracing::info;

/// Logs instead of acting.
#[derive(Debug, Default)]
pub struct DryRun;

impl Actuator for DryRun {
    fn start(&mut self, targets: &[Target], op: Op, _budget: Duration) -> Vec<Progress> {
        for t in targets {
            match op {
                Op::Suspend => info!(target = %t, "Dry run: would suspend"),
                Op::Resume => info!(target = %t, "Dry run: would resume"),
            }
        }
        targets.iter().map(|_| Progress::Skipped).collect()
    }

    fn check(&mut self, targets: &[Target], _op: Op, _budget: Duration) -> Vec<Progress> {
        targets.iter().map(|_| Progress::Skipped).collect()
    }
}
