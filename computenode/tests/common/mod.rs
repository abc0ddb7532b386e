//! What the computenode's integration tests share: a computenode serving only Redis.

use racekv_computenode::config::ComputenodeConfig;
use racekv_computenode::Computenode;
use racekv_hashing::testing::TestMemnode;

/// A computenode over `memnodes` serving only Redis (on a free loopback port; no metrics,
/// remote or attach front end), its configuration changed by `tweak` first.
pub fn redis_only(memnodes: &[&TestMemnode], tweak: impl FnOnce(&mut ComputenodeConfig)) -> Computenode {
    Computenode::start(redis_only_config(memnodes, tweak)).unwrap()
}

/// The configuration [`redis_only`] starts a computenode with.
pub fn redis_only_config(memnodes: &[&TestMemnode], tweak: impl FnOnce(&mut ComputenodeConfig)) -> ComputenodeConfig {
    let mut config = ComputenodeConfig {
        memnodes: memnodes.iter().map(|m| m.endpoint().unwrap().to_string()).collect(),
        token: TestMemnode::TOKEN.into(),
        redis_addr: Some("127.0.0.1:0".into()),
        metrics_addr: None,
        remote_addr: None,
        attach_socket: None,
        ..ComputenodeConfig::default()
    };
    tweak(&mut config);
    config
}
