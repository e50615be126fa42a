/* Stands in for HAMi-core's libvgpu.so in tests: a shared library that does
 * nothing but exist, so a test can see the loader map it into a container's
 * processes through /etc/ld.so.preload. */
int tessera_vgpu_stand_in = 1;
