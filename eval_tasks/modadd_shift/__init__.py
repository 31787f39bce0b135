"""`modadd_shift`: (a + b) mod 97 on held-out pairs, shifted and in unseen templates."""
