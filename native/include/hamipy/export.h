/* Symbol visibility for the native libraries.
 *
 * Every object is compiled with -fvisibility=hidden, so a symbol is exported only where
 * HAMI_EXPORT says so. For libvgpu.so that is exactly the hooked driver entry points and dlsym:
 * an LD_PRELOAD library that exported its helpers would shadow symbols of the program. */
#ifndef HAMIPY_EXPORT_H
#define HAMIPY_EXPORT_H

#define HAMI_EXPORT __attribute__((visibility("default")))

#endif
