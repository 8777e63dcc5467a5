//! `BRGEMM_ISA` forces the ISA of default planning; `scripts/test.sh` runs
//! this test once per ISA value (and once unset).

use brgemm::{Descriptor, Error, Isa, Kernel};

#[test]
fn brgemm_isa_is_honoured() {
    let d = Descriptor::new(5, 5, 5);
    match std::env::var("BRGEMM_ISA") {
        Ok(name) if !name.is_empty() => match Isa::parse(&name) {
            Ok(isa) if isa.is_supported() => {
                assert_eq!(Kernel::new(&d).unwrap().isa(), isa);
                println!("BRGEMM_ISA={name}: planned for {isa}");
            }
            Ok(isa) => assert_eq!(Kernel::new(&d).unwrap_err(), Error::IsaUnsupported { isa }),
            Err(_) => assert!(matches!(Kernel::new(&d), Err(Error::UnknownIsa { .. }))),
        },
        _ => assert_eq!(Kernel::new(&d).unwrap().isa(), Isa::best()),
    }
}
