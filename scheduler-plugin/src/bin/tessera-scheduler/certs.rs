//! `tessera-scheduler certs`: the CA and the extender's certificates, written once.

use anyhow::Context;

/// `certs`: the CA and certificates into `out`, never over an existing file.
pub(crate) fn write(
    out: &std::path::Path,
    service: &str,
    namespace: &str,
    days: i64,
) -> anyhow::Result<()> {
    use std::io::Write;
    let certs = tessera_scheduler::certs::generate(service, namespace, days)
        .context("generating the certificates")?;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let files = [
        ("ca.crt", &certs.ca.cert, false),
        ("ca.key", &certs.ca.key, true),
        ("tessera-scheduler.crt", &certs.scheduler.cert, false),
        ("tessera-scheduler.key", &certs.scheduler.key, true),
        (
            "tessera-kube-scheduler.crt",
            &certs.kube_scheduler.cert,
            false,
        ),
        (
            "tessera-kube-scheduler.key",
            &certs.kube_scheduler.key,
            true,
        ),
    ];
    for (name, _, _) in &files {
        let path = out.join(name);
        anyhow::ensure!(
            !path.exists(),
            "{} exists; not overwriting it",
            path.display()
        );
    }
    for (name, text, secret) in files {
        let path = out.join(name);
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create_new(true);
        if secret {
            use std::os::unix::fs::OpenOptionsExt;
            options.mode(0o600);
        }
        options
            .open(&path)
            .and_then(|mut file| file.write_all(text.as_bytes()))
            .with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
