//! TLS for every Flight connection (tonic with rustls).
//!
//! A worker serves TLS with a certificate signed by the cluster's CA; every client (the
//! driver, and workers dialing their peers) verifies it against that CA and the host of the
//! address it dials (so certificates name the hosts, or IP addresses, workers are reached
//! by). With mutual TLS a worker also asks its clients for a certificate signed by the CA.
//!
//! The local cluster makes its own CA and one certificate for `localhost` and `127.0.0.1`
//! (server and client use), at start, in its private directory ([`LocalTls::generate`]). A
//! multi-host deployment brings its own files (worker flags `--tls-cert`, `--tls-key`,
//! `--tls-ca`, `--tls-client-auth`).

use crate::error::{Error, Result};
use std::path::{Path, PathBuf};
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

/// How a client reaches TLS workers.
#[derive(Clone)]
pub struct ClientTls {
    /// PEM of the CA that signed the workers' certificates.
    pub ca: String,
    /// PEM certificate and key shown to workers that ask for one (mutual TLS).
    pub identity: Option<(String, String)>,
}

impl ClientTls {
    /// The tonic client TLS settings: trust `ca`, and show `identity` when there is one.
    pub fn config(&self) -> ClientTlsConfig {
        let cfg = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&self.ca));
        match &self.identity {
            Some((cert, key)) => cfg.identity(Identity::from_pem(cert, key)),
            None => cfg,
        }
    }
}

/// Shown without key material: the private key never reaches a log line or an error.
impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls")
            .field("ca", &format_args!("<{} bytes of PEM>", self.ca.len()))
            .field(
                "identity",
                &self.identity.as_ref().map(|_| "<certificate and key>"),
            )
            .finish()
    }
}

/// How a worker serves TLS.
#[derive(Clone)]
pub struct ServerTls {
    /// PEM of the worker's certificate, signed by the cluster's CA.
    pub cert: String,
    /// PEM of the private key of `cert`.
    pub key: String,
    /// The CA its peers' certificates are signed by (the worker dials them with it).
    pub ca: String,
    /// Mutual TLS: clients must show a certificate signed by `ca`.
    pub client_auth: bool,
}

/// Shown without key material.
impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("cert", &format_args!("<{} bytes of PEM>", self.cert.len()))
            .field("key", &"<hidden>")
            .field("client_auth", &self.client_auth)
            .finish()
    }
}

impl ServerTls {
    /// Read the PEM files a worker was given.
    pub fn from_files(cert: &Path, key: &Path, ca: &Path, client_auth: bool) -> Result<Self> {
        Ok(ServerTls {
            cert: read(cert)?,
            key: read(key)?,
            ca: read(ca)?,
            client_auth,
        })
    }

    /// The tonic server TLS settings: serve `cert`, and with `client_auth` verify clients
    /// against `ca`.
    pub fn config(&self) -> ServerTlsConfig {
        let cfg = ServerTlsConfig::new()
            .identity(Identity::from_pem(&self.cert, &self.key))
            .timeout(super::listen::HANDSHAKE_TIMEOUT);
        match self.client_auth {
            true => cfg.client_ca_root(Certificate::from_pem(&self.ca)),
            false => cfg,
        }
    }

    /// How this worker dials its peers.
    pub fn client(&self) -> ClientTls {
        ClientTls {
            ca: self.ca.clone(),
            identity: self
                .client_auth
                .then(|| (self.cert.clone(), self.key.clone())),
        }
    }
}

fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| Error::Io {
        path: path.to_path_buf(),
        source: e,
    })
}

/// A CA and one certificate it signs, made in memory (PEM text; `ca_key` signs more).
pub struct MadeTls {
    /// The CA's certificate.
    pub ca: String,
    /// The CA's private key.
    pub ca_key: String,
    /// The certificate the CA signed.
    pub cert: String,
    /// Its private key.
    pub key: String,
}

/// Shown without key material.
impl std::fmt::Debug for MadeTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MadeTls").finish_non_exhaustive()
    }
}

impl MadeTls {
    /// A new CA and a certificate it signs for `localhost`, `127.0.0.1` and `hosts`, for
    /// server and client use.
    pub fn generate(hosts: &[String]) -> Result<Self> {
        use rcgen::{
            BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
            KeyPair, KeyUsagePurpose,
        };
        let fail = |e: rcgen::Error| Error::Cluster(format!("cannot make TLS certificates: {e}"));
        let ca_key = KeyPair::generate().map_err(fail)?;
        let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(fail)?;
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        ca.distinguished_name
            .push(DnType::CommonName, "flightshuffle local cluster CA");
        let ca_cert = ca.self_signed(&ca_key).map_err(fail)?;
        let key = KeyPair::generate().map_err(fail)?;
        let mut leaf = CertificateParams::new(worker_names(hosts)).map_err(fail)?;
        leaf.distinguished_name
            .push(DnType::CommonName, "flightshuffle local worker");
        leaf.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let ca_key_pem = ca_key.serialize_pem();
        let issuer = Issuer::new(ca, ca_key);
        let cert = leaf.signed_by(&key, &issuer).map_err(fail)?;
        Ok(MadeTls {
            ca: ca_cert.pem(),
            ca_key: ca_key_pem,
            cert: cert.pem(),
            key: key.serialize_pem(),
        })
    }

    /// Serve with this certificate (clients not asked for one).
    pub fn server(&self) -> ServerTls {
        ServerTls {
            cert: self.cert.clone(),
            key: self.key.clone(),
            ca: self.ca.clone(),
            client_auth: false,
        }
    }
}

/// A local cluster's CA and its one certificate, as files in a private directory.
#[derive(Clone, Debug)]
pub struct LocalTls {
    /// Path of the CA certificate (PEM).
    pub ca: PathBuf,
    /// Path of the certificate (PEM) the CA signed, for the workers and their clients.
    pub cert: PathBuf,
    /// Path of the certificate's private key (PEM), readable by the owner only.
    pub key: PathBuf,
}

impl LocalTls {
    /// Make a CA and a certificate it signs for `localhost` and `127.0.0.1` (server and
    /// client use) and write them to `dir` (created; the key readable by the owner only).
    pub fn generate(dir: &Path) -> Result<Self> {
        Self::generate_for(dir, &[])
    }

    /// [`LocalTls::generate`] with a certificate that also names `hosts` (host names or IP
    /// addresses workers are reached by, e.g. the nodes of a Ray cluster).
    pub fn generate_for(dir: &Path, hosts: &[String]) -> Result<Self> {
        let made = MadeTls::generate(hosts)?;
        let (key, cert, ca_cert, ca_key_pem) = (made.key, made.cert, made.ca, made.ca_key);
        std::fs::create_dir_all(dir).map_err(|e| Error::Io {
            path: dir.to_path_buf(),
            source: e,
        })?;
        let files = LocalTls {
            ca: dir.join("ca.pem"),
            cert: dir.join("worker.pem"),
            key: dir.join("worker.key"),
        };
        write_private(&files.key, &key)?;
        write_private(&files.cert, &cert)?;
        write_private(&files.ca, &ca_cert)?;
        // Kept beside the CA (private, in the driver's directory) to sign the certificate
        // requests of workers that make their own keys ([`sign_request`]).
        write_private(&files.ca_key(), &ca_key_pem)?;
        Ok(files)
    }

    /// The CA's key, next to the CA certificate (written by [`Self::generate_for`]).
    pub fn ca_key(&self) -> PathBuf {
        self.ca.with_file_name("ca.key")
    }

    /// The worker flags that serve these files (`mutual`: clients must show a certificate).
    pub fn worker_args(&self, mutual: bool) -> Vec<String> {
        let mut args = vec![
            "--tls-cert".to_string(),
            self.cert.display().to_string(),
            "--tls-key".into(),
            self.key.display().to_string(),
            "--tls-ca".into(),
            self.ca.display().to_string(),
        ];
        if mutual {
            args.push("--tls-client-auth".into());
        }
        args
    }

    /// How the driver dials workers serving these files.
    pub fn client(&self, mutual: bool) -> Result<ClientTls> {
        Ok(ClientTls {
            ca: read(&self.ca)?,
            identity: match mutual {
                true => Some((read(&self.cert)?, read(&self.key)?)),
                false => None,
            },
        })
    }
}

/// The names every worker certificate carries besides its hosts.
fn worker_names(hosts: &[String]) -> Vec<String> {
    let mut names = vec!["localhost".to_string(), "127.0.0.1".into()];
    for h in hosts {
        if !names.contains(h) {
            names.push(h.clone());
        }
    }
    names
}

/// A new key for a worker, written to `key_path` (readable by its owner only), and a
/// certificate request for it (PEM) to send to whoever holds the CA: the key never leaves
/// the worker's machine.
pub fn make_request(key_path: &Path, hosts: &[String]) -> Result<String> {
    let fail = |e: rcgen::Error| Error::Cluster(format!("cannot make a certificate request: {e}"));
    let key = rcgen::KeyPair::generate().map_err(fail)?;
    let params = rcgen::CertificateParams::new(worker_names(hosts)).map_err(fail)?;
    let request = params.serialize_request(&key).map_err(fail)?;
    write_private(key_path, &key.serialize_pem())?;
    request.pem().map_err(fail)
}

/// Sign a worker's certificate request (PEM, its signature checked) with the CA of `tls`,
/// for server and client use, naming `hosts` (and loopback) whatever the request asked for:
/// the signer, not the requester, decides which names a worker may answer for.
pub fn sign_request(tls: &LocalTls, request_pem: &str, hosts: &[String]) -> Result<String> {
    use rcgen::{CertificateSigningRequestParams, DnType, ExtendedKeyUsagePurpose, Issuer};
    let bad = |e: rcgen::Error| Error::invalid(format!("not a valid certificate request: {e}"));
    let fail = |e: rcgen::Error| Error::Cluster(format!("cannot sign a certificate: {e}"));
    let mut request = CertificateSigningRequestParams::from_pem(request_pem).map_err(bad)?;
    let ca_key = rcgen::KeyPair::from_pem(&read(&tls.ca_key())?).map_err(fail)?;
    let issuer = Issuer::from_ca_cert_pem(&read(&tls.ca)?, ca_key).map_err(fail)?;
    let mut params = rcgen::CertificateParams::new(worker_names(hosts)).map_err(fail)?;
    params
        .distinguished_name
        .push(DnType::CommonName, "flightshuffle worker");
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    request.params = params;
    Ok(request.signed_by(&issuer).map_err(fail)?.pem())
}

fn write_private(path: &Path, text: &str) -> Result<()> {
    use std::io::Write;
    let io = |e| Error::Io {
        path: path.to_path_buf(),
        source: e,
    };
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    let mut f = opts.open(path).map_err(io)?;
    f.write_all(text.as_bytes()).map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `Debug` of TLS settings (what a log line or an error would show) holds no key.
    #[test]
    fn debug_output_shows_no_key_material() {
        let key = "-----BEGIN PRIVATE KEY-----\nc2VjcmV0\n-----END PRIVATE KEY-----\n";
        let server = ServerTls {
            cert: "CERT".into(),
            key: key.into(),
            ca: "CA".into(),
            client_auth: true,
        };
        let client = ClientTls {
            ca: "CA".into(),
            identity: Some(("CERT".into(), key.into())),
        };
        for shown in [format!("{server:?}"), format!("{client:?}")] {
            assert!(
                !shown.contains("c2VjcmV0") && !shown.contains("PRIVATE"),
                "{shown}"
            );
        }
    }

    #[test]
    fn a_worker_request_is_signed_for_the_names_the_signer_chooses_and_a_forged_one_refused() {
        let dir = tempfile::tempdir().unwrap();
        let tls = LocalTls::generate(dir.path()).unwrap();
        let key = dir.path().join("w.key");
        let request = make_request(&key, &["10.9.8.7".into(), "evil.example".into()]).unwrap();
        assert!(read(&key).unwrap().contains("PRIVATE KEY"));
        let cert = sign_request(&tls, &request, &["10.9.8.7".into()]).unwrap();
        assert!(cert.starts_with("-----BEGIN CERTIFICATE-----"), "{cert}");
        // The signed certificate works with the worker's own key (both parse as a pair).
        ServerTls {
            cert: cert.clone(),
            key: read(&key).unwrap(),
            ca: read(&tls.ca).unwrap(),
            client_auth: false,
        }
        .config();
        // A request whose body was altered fails its signature check.
        let lines: Vec<&str> = request.lines().collect();
        let mut body = lines[1].to_string();
        let flipped = if body.ends_with('A') { 'B' } else { 'A' };
        body.pop();
        body.push(flipped);
        let forged = request.replacen(lines[1], &body, 1);
        let err = sign_request(&tls, &forged, &[]).unwrap_err().to_string();
        assert!(err.contains("not a valid certificate request"), "{err}");
        assert!(sign_request(&tls, "garbage", &[]).is_err());
    }
}
