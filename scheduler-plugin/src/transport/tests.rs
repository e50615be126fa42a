use super::*;

fn addr(text: &str) -> SocketAddr {
    text.parse().expect("address")
}

#[test]
fn plain_http_only_on_loopback() {
    assert_eq!(
        choose_transport(addr("127.0.0.1:18888"), None, None, None, false),
        Ok(Transport::PlainLoopback)
    );
    assert_eq!(
        choose_transport(addr("[::1]:18888"), None, None, None, false),
        Ok(Transport::PlainLoopback)
    );
    let refused = choose_transport(addr("0.0.0.0:8888"), None, None, None, false);
    assert_eq!(
        refused,
        Err(ListenError::PlainOnNetwork {
            addr: addr("0.0.0.0:8888")
        })
    );
    let message = refused.expect_err("refused").to_string();
    assert!(message.starts_with("--listen 0.0.0.0:8888: plain HTTP on a non-loopback address is refused: anything that can reach it could POST /bind"), "{message}");
    assert!(message.contains("--insecure-listen"), "{message}");
    assert_eq!(
        choose_transport(addr("0.0.0.0:8888"), None, None, None, true),
        Ok(Transport::PlainInsecure)
    );
}

#[test]
fn tls_needs_all_three_files_and_no_insecure_flag() {
    let p = |s: &str| Some(PathBuf::from(s));
    assert_eq!(
        choose_transport(addr("0.0.0.0:8888"), p("c"), p("k"), p("ca"), false),
        Ok(Transport::MutualTls(TlsFiles {
            cert: "c".into(),
            key: "k".into(),
            client_ca: "ca".into()
        }))
    );
    assert_eq!(
        choose_transport(addr("0.0.0.0:8888"), p("c"), None, None, false)
            .expect_err("partial")
            .to_string(),
        "mutual TLS needs --tls-cert-file, --tls-key-file and --client-ca-file together; missing --tls-key-file, --client-ca-file"
    );
    assert_eq!(
        choose_transport(addr("0.0.0.0:8888"), p("c"), p("k"), p("ca"), true),
        Err(ListenError::InsecureWithTls)
    );
}

fn identity(cn: &[&str], dns: &[&str]) -> ClientIdentity {
    ClientIdentity {
        common_names: cn.iter().map(|s| s.to_string()).collect(),
        dns_names: dns.iter().map(|s| s.to_string()).collect(),
    }
}

#[test]
fn only_kube_scheduler_binds_and_a_replica_only_what_it_hands_over() {
    let access = BindAccess::default();
    let kube_scheduler = identity(&["tessera-kube-scheduler"], &[]);
    let by_san = identity(&["someone"], &["tessera-kube-scheduler"]);
    let replica = identity(
        &["tessera-scheduler"],
        &["tessera-scheduler.tessera-system.svc"],
    );
    let tenant = identity(&["tenant"], &["tenant.example"]);
    for path in ["/filter", "/prioritize", "/healthz"] {
        assert_eq!(access.authorize(path, false, &tenant), Ok(()), "{path}");
    }
    assert_eq!(access.authorize("/bind", false, &kube_scheduler), Ok(()));
    assert_eq!(access.authorize("/bind", false, &by_san), Ok(()));
    assert_eq!(access.authorize("/bind", true, &replica), Ok(()));
    assert_eq!(
        access
            .authorize("/bind", false, &replica)
            .expect_err("a replica binds only a handed-over bind")
            .to_string(),
        "client CN=\"tessera-scheduler\" DNS=\"tessera-scheduler.tessera-system.svc\" may not bind: only tessera-kube-scheduler may (--bind-client-name)"
    );
    // The verb is the path's last segment, as the extender routes it.
    for path in ["/bind", "/bind/", "/prefix/bind", "//bind"] {
        assert!(access.authorize(path, true, &tenant).is_err(), "{path}");
    }
    let no_peer = BindAccess {
        peer: None,
        ..BindAccess::default()
    };
    assert!(no_peer.authorize("/bind", true, &replica).is_err());
}

#[test]
fn identity_reads_cn_and_dns_sans() {
    let ca = crate::certs::CertificateAuthority::new("test-ca", 1).expect("ca");
    let pem = ca
        .issue(
            "tessera-kube-scheduler",
            &["a.example".into(), "b.example".into()],
            false,
            true,
        )
        .expect("cert");
    let der = CertificateDer::from_pem_slice(pem.cert.as_bytes()).expect("der");
    assert_eq!(
        ClientIdentity::from_der(&der),
        Ok(identity(
            &["tessera-kube-scheduler"],
            &["a.example", "b.example"]
        ))
    );
    assert!(ClientIdentity::from_der(b"not a certificate").is_err());
}

#[test]
fn the_serving_certificates_expiry_is_read() -> Result<(), Box<dyn std::error::Error>> {
    let ca = crate::certs::CertificateAuthority::new("test-ca", 30)?;
    let issued = ca.issue(
        "tessera-scheduler",
        &["tessera-scheduler".into()],
        true,
        false,
    )?;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("tls.crt");
    std::fs::write(&path, &issued.cert)?;
    let not_after = certificate_not_after(&path)?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs();
    let days = (not_after - i64::try_from(now)?) / 86_400;
    assert!((0..=31).contains(&days), "{days} days left");
    std::fs::write(&path, "not a certificate")?;
    assert!(certificate_not_after(&path).is_err());
    Ok(())
}
