pub mod x{}
