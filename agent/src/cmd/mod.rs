//! Subcommands that are not the agent itself: `status` (a running agent's `/state`, and
//! its timeline as a picture) and the timeline renderer it shares with the demo.

pub mod status;
pub mod timeline;
