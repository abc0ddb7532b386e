//! The conformance suite on every backend this build has.

mod shm {
    racekv_transport::conformance_suite!(racekv_transport::conformance::fixtures::SHM);
}

mod tcp {
    racekv_transport::conformance_suite!(racekv_transport::conformance::fixtures::TCP);
}
