//! The conformance suite on every backend this build has.

mod shm {
    racekv_transport::conformance_suite!(racekv_transport::conformance::fixtures::SHM);
}

mod tcp {
    racekv_transport::conformance_suite!(racekv_transport::conformance::fixtures::TCP);
}

/// tcp inside mutual TLS (certificates made up per region).
mod tcp_tls {
    racekv_transport::conformance_suite!(racekv_transport::conformance::fixtures::TCP_TLS);
}

/// Needs an RDMA device: run in the Soft-RoCE VM (ops/vm/run-cargo-tests.sh). Without one
/// these fail with "no RDMA device found", never pass vacuously.
#[cfg(feature = "rdma")]
mod verbs {
    racekv_transport::conformance_suite!(racekv_transport::conformance::fixtures::VERBS);
}
