//! The racekv compute node: the per-host daemon that runs workers over pre-initialized
//! connections to the memory nodes, and the front ends applications talk to.
//!
//! So far it holds the [`redis`] front end, written against a storage trait so that it can be
//! built and tested before the RACE table workers exist.

pub mod redis;
