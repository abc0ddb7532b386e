//! TLS settings as daemons' configurations spell them (Redis' names: `tls_cert_file`,
//! `tls_key_file`, `tls_ca_file`, `tls_auth_clients`), and the rules they must follow. One
//! place, so every daemon checks them alike; the transport turns them into a server's TLS.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// Whether TLS clients must present a certificate (Redis' `tls-auth-clients`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TlsAuthClients {
    /// No client certificates: the password or token alone authenticates.
    #[default]
    No,
    /// A certificate, when presented, must chain to the CA.
    Optional,
    /// Every client presents a certificate that chains to the CA.
    Yes,
}

/// Checks a server's TLS settings: certificate and key come together, a CA or a client
/// certificate rule only with them, and asking for client certificates needs a CA. Returns
/// whether TLS is on.
pub fn check_server_settings(
    cert_file: Option<&Path>,
    key_file: Option<&Path>,
    ca_file: Option<&Path>,
    auth_clients: TlsAuthClients,
) -> anyhow::Result<bool> {
    anyhow::ensure!(
        cert_file.is_some() == key_file.is_some(),
        "tls_cert_file and tls_key_file go together: set both for TLS, or neither"
    );
    let tls = cert_file.is_some();
    anyhow::ensure!(
        tls || (ca_file.is_none() && auth_clients == TlsAuthClients::No),
        "tls_ca_file and tls_auth_clients need TLS: set tls_cert_file and tls_key_file"
    );
    anyhow::ensure!(
        auth_clients == TlsAuthClients::No || ca_file.is_some(),
        "tls_auth_clients = {auth_clients:?} needs tls_ca_file, the CA client certificates must chain to"
    );
    Ok(tls)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rules_hold() {
        let (cert, key, ca) = (Some(Path::new("c")), Some(Path::new("k")), Some(Path::new("ca")));
        assert!(!check_server_settings(None, None, None, TlsAuthClients::No).unwrap());
        assert!(check_server_settings(cert, key, None, TlsAuthClients::No).unwrap());
        assert!(check_server_settings(cert, key, ca, TlsAuthClients::Yes).unwrap());
        assert!(check_server_settings(cert, None, None, TlsAuthClients::No).is_err());
        assert!(check_server_settings(None, None, ca, TlsAuthClients::No).is_err());
        assert!(check_server_settings(cert, key, None, TlsAuthClients::Optional).is_err());
    }
}
