//! Test images of another size than the training images are an error
//! naming both sizes (they were once evaluated as garbage, or panicked).

use std::io::Write;

fn idx(path: &std::path::Path, dims: &[u32], fill: u8) {
    let mut f = std::fs::File::create(path).unwrap();
    f.write_all(&[0, 0, 8, dims.len() as u8]).unwrap();
    for d in dims {
        f.write_all(&d.to_be_bytes()).unwrap();
    }
    let n: u32 = dims.iter().product();
    f.write_all(&vec![fill; n as usize]).unwrap();
}

#[test]
fn test_images_of_another_size_are_refused() {
    let dir = std::env::temp_dir().join(format!("brgemm-mismatch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    idx(&dir.join("train-images-idx3-ubyte"), &[2, 28, 28], 7);
    idx(&dir.join("train-labels-idx1-ubyte"), &[2], 1);
    idx(&dir.join("t10k-images-idx3-ubyte"), &[1, 30, 30], 7);
    idx(&dir.join("t10k-labels-idx1-ubyte"), &[1], 1);
    let e = brgemm_dl::data::fashion_mnist(&dir)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("(1, 30, 30)") && e.contains("(1, 28, 28)"),
        "{e}"
    );
    // The same sizes load.
    idx(&dir.join("t10k-images-idx3-ubyte"), &[1, 28, 28], 7);
    let (tr, te) = brgemm_dl::data::fashion_mnist(&dir).unwrap();
    assert_eq!((tr.dims, te.dims), ((1, 28, 28), (1, 28, 28)));
    std::fs::remove_dir_all(&dir).ok();
}
