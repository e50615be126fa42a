//! `tessera-enforce hami-prime`, the real binary, with the harness's stand-in for
//! HAMi-core (which writes its region from its env on the first `cu*` lookup, as
//! HAMi-core does): the region gets the grant's env and nothing else, once; a
//! library that writes nothing is refused, named.

use std::path::PathBuf;

use tessera_enforce::hami::{PrimeError, Primer};

fn primer(library: PathBuf) -> Primer {
    Primer {
        binary: PathBuf::from(env!("CARGO_BIN_EXE_tessera-enforce")),
        library,
    }
}

#[test]
fn the_region_is_written_by_the_preloaded_library_from_the_grant_alone()
-> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let library = tessera_harness::image::vgpu_stand_in(&dir.path().join("hami"))
        .map_err(|e| e.to_string())?;
    let region = dir.path().join("cudevshr.cache");
    std::fs::write(&region, b"")?;
    let env = [
        ("CUDA_DEVICE_MEMORY_LIMIT_0".to_owned(), "20480m".to_owned()),
        ("CUDA_DEVICE_SM_LIMIT".to_owned(), "25".to_owned()),
        // The hook's name for it inside the container; the primer uses the host's.
        (
            "CUDA_DEVICE_MEMORY_SHARED_CACHE".to_owned(),
            "/tmp/cudevshr.cache".to_owned(),
        ),
    ];
    assert!(primer(library.clone()).prime(&region, &env)?);
    let written = std::fs::read_to_string(&region)?;
    assert_eq!(
        written,
        "tessera-vgpu-stand-in region\nwriter=tessera-enforce\nCUDA_DEVICE_MEMORY_LIMIT_0=20480m\nCUDA_DEVICE_SM_LIMIT=25\n"
    );
    // Written regions are kept: a restarted container keeps its grant.
    let more = [("CUDA_DEVICE_MEMORY_LIMIT_0".to_owned(), "70000m".to_owned())];
    assert!(!primer(library).prime(&region, &more)?);
    assert_eq!(std::fs::read_to_string(&region)?, written);
    Ok(())
}

#[test]
fn a_library_that_writes_no_region_is_refused_by_name() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let region = dir.path().join("cudevshr.cache");
    let library = dir.path().join("not-hami-core.so");
    let error = primer(library.clone()).prime(&region, &[]).err();
    let Some(PrimeError::Failed { stderr, .. }) = &error else {
        panic!("want Failed, got {error:?}");
    };
    assert!(
        stderr.contains("did not write the region") && stderr.contains("not-hami-core.so"),
        "{stderr}"
    );
    assert!(!region.exists() || std::fs::metadata(&region)?.len() == 0);
    Ok(())
}
