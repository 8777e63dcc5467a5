//! The descriptor-keyed kernel cache and thread sharing.

use brgemm::{dispatch, Batch, Beta, Descriptor, Kernel};
use std::sync::Arc;

#[test]
fn kernel_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Kernel>();
    assert_send_sync::<Arc<Kernel>>();
}

#[test]
fn same_descriptor_same_kernel_object_across_threads() {
    let d = Descriptor::new(37, 11, 13).beta(Beta::One);
    let first = dispatch(&d).unwrap();
    let handles: Vec<_> = (0..4)
        .map(|_| std::thread::spawn(move || dispatch(&d).unwrap()))
        .collect();
    for h in handles {
        assert!(Arc::ptr_eq(&first, &h.join().unwrap()));
    }
    let other = dispatch(&d.alpha(0.5)).unwrap();
    assert!(!Arc::ptr_eq(&first, &other));
}

#[test]
fn one_kernel_called_from_many_threads() {
    let k = dispatch(&Descriptor::new(16, 16, 16)).unwrap();
    let a = vec![1.0f32; 16 * 16 * 2];
    let b = vec![0.25f32; 16 * 16 * 2];
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                let mut c = vec![0.0f32; 256];
                for _ in 0..100 {
                    k.execute(
                        Batch::Stride {
                            a: &a,
                            b: &b,
                            count: 2,
                        },
                        &mut c,
                        None,
                    )
                    .unwrap();
                }
                assert!(c.iter().all(|&x| x == 8.0));
            });
        }
    });
}
