//! `tessera-reporter`: what a GPU node has and who holds it.
//!
//! - [`checkpoint`]: kubelet's device checkpoint → legacy pods' GPUs.

pub mod checkpoint;
