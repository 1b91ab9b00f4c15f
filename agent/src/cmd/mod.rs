//! Subcommands that are not the agent itself: `status` (a running agent's `/state`, and
//! its timeline as a picture), `resume` (what a killed agent left suspended) and the
//! timeline renderer `status` shares with the demo, and `exec` (a command under the
//! shim).

pub mod exec;
pub mod probe;
pub mod resume;
pub mod status;
pub mod timeline;
