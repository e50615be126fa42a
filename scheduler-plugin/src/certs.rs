//! The certificates of the extender's mutual TLS, made without cert-manager or
//! openssl (`tessera-scheduler certs`): a CA, the replicas' certificate (serving, and
//! client when a follower hands a bind to the leader) and kube-scheduler's client
//! certificate. Pure: PEM text in memory; the binary writes the files.

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use time::{Duration, OffsetDateTime};

use crate::transport::{DEFAULT_BIND_CLIENT, DEFAULT_PEER_CLIENT};

/// A certificate and its private key, PEM.
#[derive(Debug, Clone)]
pub struct Pem {
    /// The certificate.
    pub cert: String,
    /// Its private key (PKCS#8).
    pub key: String,
}

/// A CA that issues the extender's certificates.
pub struct CertificateAuthority {
    pem: Pem,
    issuer: Issuer<'static, KeyPair>,
    days: i64,
}

impl std::fmt::Debug for CertificateAuthority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertificateAuthority")
            .field("days", &self.days)
            .finish_non_exhaustive()
    }
}

fn validity(params: &mut CertificateParams, days: i64) {
    let now = OffsetDateTime::now_utc();
    // An hour back: clocks of the nodes that check it may lag this one's.
    params.not_before = now - Duration::hours(1);
    params.not_after = now + Duration::days(days);
}

fn named(common_name: &str) -> DistinguishedName {
    let mut name = DistinguishedName::new();
    name.push(DnType::CommonName, common_name);
    name
}

impl CertificateAuthority {
    /// A new self-signed CA named `common_name`; it and what it issues are valid
    /// for `days`.
    pub fn new(common_name: &str, days: i64) -> Result<Self, rcgen::Error> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::default();
        params.distinguished_name = named(common_name);
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        validity(&mut params, days);
        let cert = params.self_signed(&key)?;
        let pem = Pem {
            cert: cert.pem(),
            key: key.serialize_pem(),
        };
        Ok(Self {
            pem,
            issuer: Issuer::new(params, key),
            days,
        })
    }

    /// The CA's own certificate and key.
    pub fn pem(&self) -> &Pem {
        &self.pem
    }

    /// A certificate for `common_name` with `dns_names` as DNS SANs, for serving
    /// (`server`) and/or as a client (`client`).
    pub fn issue(
        &self,
        common_name: &str,
        dns_names: &[String],
        server: bool,
        client: bool,
    ) -> Result<Pem, rcgen::Error> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(dns_names.to_vec())?;
        params.distinguished_name = named(common_name);
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        if server {
            params
                .extended_key_usages
                .push(ExtendedKeyUsagePurpose::ServerAuth);
        }
        if client {
            params
                .extended_key_usages
                .push(ExtendedKeyUsagePurpose::ClientAuth);
        }
        validity(&mut params, self.days);
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(Pem {
            cert: cert.pem(),
            key: key.serialize_pem(),
        })
    }
}

/// The DNS names of the extender's Service `service` in `namespace`, the one
/// kube-scheduler's `tlsConfig.serverName` and the followers verify first.
pub fn service_dns_names(service: &str, namespace: &str) -> Vec<String> {
    vec![
        format!("{service}.{namespace}.svc"),
        format!("{service}.{namespace}.svc.cluster.local"),
        format!("{service}.{namespace}"),
        service.to_owned(),
    ]
}

/// Everything `tessera-scheduler certs` writes.
#[derive(Debug, Clone)]
pub struct ExtenderCerts {
    /// The CA (its key is needed only to issue more).
    pub ca: Pem,
    /// The replicas' certificate: CN `tessera-scheduler`, the Service's DNS names,
    /// serving and client (a follower presents it to the leader).
    pub scheduler: Pem,
    /// kube-scheduler's client certificate: CN and DNS SAN `tessera-kube-scheduler`.
    pub kube_scheduler: Pem,
}

/// A fresh CA and the two certificates it signs, valid for `days`.
pub fn generate(service: &str, namespace: &str, days: i64) -> Result<ExtenderCerts, rcgen::Error> {
    let ca = CertificateAuthority::new("tessera-extender-ca", days)?;
    let scheduler = ca.issue(
        DEFAULT_PEER_CLIENT,
        &service_dns_names(service, namespace),
        true,
        true,
    )?;
    let kube_scheduler = ca.issue(
        DEFAULT_BIND_CLIENT,
        &[DEFAULT_BIND_CLIENT.to_owned()],
        false,
        true,
    )?;
    Ok(ExtenderCerts {
        ca: ca.pem().clone(),
        scheduler,
        kube_scheduler,
    })
}
