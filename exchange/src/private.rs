//! Files and directories private to the user running flightshuffle: every directory it makes
//! is 0700 and every file 0600, created exclusively (an existing path, or a symlink planted
//! in its place, is an error, never followed), so spilled blocks, kept map inputs and tables
//! written for workers cannot be read or replaced by another local user.

use crate::error::{Error, Result};
use std::fs::{DirBuilder, File, OpenOptions};
use std::path::Path;

/// Make `dir` (and missing parents) with mode 0700; returns whether `dir` itself was made
/// here (false: it existed, and is then left as it is, but must be a directory owned by this
/// user).
pub fn create_dir(dir: &Path) -> Result<bool> {
    if let Ok(meta) = std::fs::symlink_metadata(dir) {
        check_owned(dir, &meta)?;
        return Ok(false);
    }
    let mut b = DirBuilder::new();
    b.recursive(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::DirBuilderExt;
        b.mode(0o700);
    }
    b.create(dir).map_err(|e| Error::io(dir, e))?;
    Ok(true)
}

/// A new file at `path`, mode 0600, opened for reading and writing; an existing path is an
/// error.
pub fn create_file(path: &Path) -> Result<File> {
    let mut opts = OpenOptions::new();
    opts.create_new(true).write(true).read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    opts.open(path).map_err(|e| Error::io(path, e))
}

/// An existing directory is usable only if it is a real directory (not a symlink) owned by
/// this user.
fn check_owned(dir: &Path, meta: &std::fs::Metadata) -> Result<()> {
    if !meta.is_dir() {
        return Err(Error::invalid(format!(
            "{} exists and is not a directory (a symlink is not followed)",
            dir.display()
        )));
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        // SAFETY: geteuid has no preconditions and cannot fail.
        let me = unsafe { libc::geteuid() };
        if meta.uid() != me {
            return Err(Error::invalid(format!(
                "{} is owned by another user (uid {}): refusing to keep private files there",
                dir.display(),
                meta.uid()
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn directories_are_0700_files_0600_and_never_reused() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("a/b");
        assert!(create_dir(&dir).unwrap());
        assert!(
            !create_dir(&dir).unwrap(),
            "an existing own directory is kept"
        );
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir), 0o700);
        let f = dir.join("x");
        create_file(&f).unwrap();
        assert_eq!(mode(&f), 0o600);
        assert!(create_file(&f).is_err(), "an existing file is not reused");
        // A symlink where a file or directory would go is refused, never followed.
        let target = t.path().join("target");
        std::fs::create_dir(&target).unwrap();
        let link = t.path().join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert!(create_dir(&link).is_err());
        let flink = t.path().join("flink");
        std::os::unix::fs::symlink(t.path().join("elsewhere"), &flink).unwrap();
        assert!(
            create_file(&flink).is_err(),
            "a dangling symlink is not followed"
        );
    }
}
