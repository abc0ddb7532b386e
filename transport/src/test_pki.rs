//! Certificates for tests (feature `test-pki`): a throwaway CA that issues leaves usable by
//! servers and clients both, written as PEM files.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
};

/// A certificate authority made up for one test.
pub struct TestCa {
    issuer: Issuer<'static, KeyPair>,
    cert_pem: String,
}

impl TestCa {
    pub fn new(name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().expect("a CA key");
        let cert_pem = params.self_signed(&key).expect("a self-signed CA").pem();
        Self { issuer: Issuer::new(params, key), cert_pem }
    }

    /// Writes the CA's certificate to `path`.
    pub fn write_cert(&self, path: &Path) -> PathBuf {
        std::fs::write(path, &self.cert_pem).expect("writing the CA certificate");
        path.to_path_buf()
    }

    /// Issues a leaf for `names` (DNS names or IP addresses), for server and client use, and
    /// writes its certificate and key to `cert` and `key`.
    pub fn write_leaf(&self, names: &[&str], cert: &Path, key: &Path) {
        let mut params =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).expect("leaf names");
        params.distinguished_name.push(DnType::CommonName, names.first().copied().unwrap_or("client"));
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        let leaf_key = KeyPair::generate().expect("a leaf key");
        let leaf = params.signed_by(&leaf_key, &self.issuer).expect("a signed leaf");
        std::fs::write(cert, leaf.pem()).expect("writing the leaf certificate");
        std::fs::write(key, leaf_key.serialize_pem()).expect("writing the leaf key");
    }
}

/// A CA with one server leaf (for `localhost` and 127.0.0.1) and one client leaf, in a
/// temporary directory: `ca.pem`, `server.pem`, `server.key`, `client.pem`, `client.key`.
pub struct TestPki {
    pub dir: tempfile::TempDir,
    pub ca: TestCa,
}

impl TestPki {
    pub fn new(name: &str) -> Self {
        let pki = Self { dir: tempfile::tempdir().expect("a temporary directory"), ca: TestCa::new(name) };
        pki.ca.write_cert(&pki.path("ca.pem"));
        pki.ca.write_leaf(&["localhost", "127.0.0.1"], &pki.path("server.pem"), &pki.path("server.key"));
        pki.ca.write_leaf(&["client"], &pki.path("client.pem"), &pki.path("client.key"));
        pki
    }

    pub fn path(&self, file: &str) -> PathBuf {
        self.dir.path().join(file)
    }

    /// Server settings from these files.
    pub fn server_files(&self, auth_clients: crate::ClientAuth) -> crate::ServerTlsFiles {
        crate::ServerTlsFiles {
            cert_file: self.path("server.pem"),
            key_file: self.path("server.key"),
            ca_file: Some(self.path("ca.pem")),
            auth_clients,
        }
    }

    /// A client trusting this CA, presenting no certificate.
    pub fn client(&self) -> crate::ClientTls {
        crate::ClientTls::new(self.path("ca.pem")).expect("loading the test CA")
    }

    /// A client trusting this CA and presenting the client leaf.
    pub fn mutual_client(&self) -> crate::ClientTls {
        self.client().with_client_cert(self.path("client.pem"), self.path("client.key")).expect("the client leaf")
    }
}
