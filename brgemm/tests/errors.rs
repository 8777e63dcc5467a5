//! Bad input, table-driven: every invalid descriptor field and every short or
//! mismatched argument returns an error that names it.

use brgemm::{
    Batch, BatchForm, Descriptor, Epilogue, Error, Isa, Kernel, KernelOptions, Offsets,
    RegisterTile,
};

#[test]
fn invalid_descriptors_name_field_and_value() {
    let big = usize::MAX / 4;
    let table: Vec<(Descriptor, &str, String)> = vec![
        (Descriptor::new(0, 4, 4), "m", "0".into()),
        (Descriptor::new(4, 0, 4), "n", "0".into()),
        (Descriptor::new(4, 4, 0), "k", "0".into()),
        (Descriptor::new(8, 4, 4).lda(7), "lda", "7".into()),
        (Descriptor::new(8, 4, 4).ldb(3), "ldb", "3".into()),
        (Descriptor::new(8, 4, 4).ldc(5), "ldc", "5".into()),
        (Descriptor::new(8, 4, 4).lda(big), "lda", big.to_string()),
        (Descriptor::new(8, 4, 4).ldb(big), "ldb", big.to_string()),
        (Descriptor::new(8, 4, 4).ldc(big), "ldc", big.to_string()),
        (Descriptor::new(big, 4, 4), "m", big.to_string()),
        (
            Descriptor::new(8, 4, 4).alpha(f32::NAN),
            "alpha",
            "NaN".into(),
        ),
        (
            Descriptor::new(8, 4, 4).batch_form(BatchForm::Stride { a: big, b: 1 }),
            "stride_a",
            big.to_string(),
        ),
    ];
    for (d, field, value) in table {
        let e = Kernel::new(&d).unwrap_err();
        match &e {
            Error::InvalidDescriptor {
                field: f, value: v, ..
            } => {
                assert_eq!((*f, v.as_str()), (field, value.as_str()), "{d:?}");
            }
            other => panic!("{d:?}: expected InvalidDescriptor, got {other:?}"),
        }
        let msg = e.to_string();
        assert!(msg.contains(field) && msg.contains(&value), "{msg}");
    }
}

#[test]
fn invalid_tile_and_isa_are_refused() {
    let d = Descriptor::new(8, 8, 8);
    let t = RegisterTile { mv: 9, nr: 1 };
    let e = Kernel::with_options(
        &d,
        KernelOptions {
            isa: Some(Isa::Portable),
            tile: Some(t),
            bf16: None,
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("9x1"), "{e}");
    assert!(matches!(Isa::parse("sse9"), Err(Error::UnknownIsa { .. })));
    for isa in Isa::ALL {
        if !isa.is_supported() {
            let e = Kernel::with_options(
                &d,
                KernelOptions {
                    isa: Some(isa),
                    tile: None,
                    bf16: None,
                },
            )
            .unwrap_err();
            assert_eq!(e, Error::IsaUnsupported { isa });
        }
    }
}

fn short(e: Error) -> (String, usize, usize) {
    match e {
        Error::ShortSlice {
            operand,
            needed,
            len,
        } => (operand, needed, len),
        other => panic!("expected ShortSlice, got {other:?}"),
    }
}

#[test]
fn short_slices_are_reported_per_operand() {
    // m=4, n=3, k=2, packed: A_i 8, B_i 6, C 12.
    let d = Descriptor::new(4, 3, 2);
    let k = Kernel::new(&d).unwrap();
    let (a, b) = (vec![1.0; 16], vec![1.0; 12]);
    let mut c = vec![0.0; 12];
    let run = |a: &[f32], b: &[f32], c: &mut [f32], count| {
        k.execute(Batch::Stride { a, b, count }, c, None)
            .unwrap_err()
    };
    assert_eq!(short(run(&a[..15], &b, &mut c, 2)), ("A".into(), 16, 15));
    assert_eq!(short(run(&a, &b[..11], &mut c, 2)), ("B".into(), 12, 11));
    assert_eq!(short(run(&a, &b, &mut c[..11], 2)), ("C".into(), 12, 11));
    assert_eq!(short(run(&a, &b, &mut c, 3)), ("A".into(), 24, 16));
    // count 0 needs no A or B at all.
    k.execute(
        Batch::Stride {
            a: &[0.0f32; 0],
            b: &[],
            count: 0,
        },
        &mut c,
        None,
    )
    .unwrap();
    // A huge count overflows instead of wrapping.
    assert!(matches!(
        run(&a, &b, &mut c, usize::MAX),
        Error::Overflow { what: "batch", .. }
    ));
}

#[test]
fn bias_must_match_the_epilogue() {
    let d = Descriptor::new(4, 3, 2).epilogue(Epilogue {
        bias: true,
        ..Default::default()
    });
    let k = Kernel::new(&d).unwrap();
    let (a, b) = (vec![1.0; 8], vec![1.0; 6]);
    let mut c = vec![0.0; 12];
    let batch = Batch::Stride {
        a: &a,
        b: &b,
        count: 1,
    };
    assert!(
        matches!(k.execute(batch, &mut c, None), Err(Error::BatchMismatch(m)) if m.contains("bias missing"))
    );
    assert_eq!(
        short(k.execute(batch, &mut c, Some(&[0.0; 3])).unwrap_err()),
        ("bias".into(), 4, 3)
    );
    k.execute(batch, &mut c, Some(&[0.0; 4])).unwrap();
    let plain = Kernel::new(&Descriptor::new(4, 3, 2)).unwrap();
    assert!(
        matches!(plain.execute(batch, &mut c, Some(&[0.0; 4])), Err(Error::BatchMismatch(m)) if m.contains("bias given"))
    );
}

#[test]
fn offset_and_address_forms_check_every_matrix() {
    let d = Descriptor::new(4, 3, 2).batch_form(BatchForm::Offset);
    let k = Kernel::new(&d).unwrap();
    let (a, b) = (vec![1.0; 20], vec![1.0; 20]);
    let mut c = vec![0.0; 12];
    let offs = Offsets::new(vec![0, 13], vec![0, 6]).unwrap();
    let e = k
        .execute(
            Batch::Offset {
                a: &a,
                b: &b,
                offsets: &offs,
            },
            &mut c,
            None,
        )
        .unwrap_err();
    assert_eq!(short(e), ("A".into(), 21, 20));
    assert!(matches!(
        Offsets::new(vec![0], vec![]),
        Err(Error::BatchMismatch(_))
    ));

    let d = Descriptor::new(4, 3, 2).batch_form(BatchForm::Address);
    let k = Kernel::new(&d).unwrap();
    let (a0, a1, b0) = (vec![1.0; 8], vec![1.0; 7], vec![1.0; 6]);
    let e = k
        .execute(
            Batch::Address {
                a: &[&a0, &a1],
                b: &[&b0, &b0],
            },
            &mut c,
            None,
        )
        .unwrap_err();
    assert_eq!(short(e), ("A[1]".into(), 8, 7));
    let e = k
        .execute(
            Batch::Address {
                a: &[&a0],
                b: &[&b0, &b0],
            },
            &mut c,
            None,
        )
        .unwrap_err();
    assert!(matches!(e, Error::BatchMismatch(m) if m.contains("1 A slices but 2 B")));
}

#[test]
fn batch_form_must_match_the_plan() {
    let k = Kernel::new(&Descriptor::new(4, 3, 2)).unwrap();
    let (a, b) = (vec![1.0; 8], vec![1.0; 6]);
    let mut c = vec![0.0; 12];
    let e = k
        .execute(Batch::Address { a: &[&a], b: &[&b] }, &mut c, None)
        .unwrap_err();
    assert!(
        matches!(e, Error::BatchMismatch(m) if m.contains("address batch given") && m.contains("stride form"))
    );
}

#[test]
fn row_major_b_checks_ldb_against_n_and_is_f32_only() {
    use brgemm::{DataType, Descriptor};
    let e = Descriptor::new(8, 16, 4)
        .b_row_major()
        .ldb(8)
        .validate()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("ldb") && e.contains("n (row-major B) = 16"),
        "{e}"
    );
    assert!(Descriptor::new(8, 16, 4)
        .b_row_major()
        .ldb(20)
        .validate()
        .is_ok());
    let e = Descriptor::new(32, 32, 32)
        .b_row_major()
        .dtype(DataType::Bf16)
        .validate()
        .unwrap_err()
        .to_string();
    assert!(e.contains("b_row_major"), "{e}");
    // Packed stride of a row-major B is ldb * k.
    let d = Descriptor::new(8, 16, 4)
        .b_row_major()
        .ldb(20)
        .validate()
        .unwrap();
    assert_eq!(d.batch_form, brgemm::BatchForm::Stride { a: 32, b: 80 });
}
