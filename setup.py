"""gluon_unet: data-parallel U-Net training on all the GPUs of a machine with MXNet Gluon."""
import os

from setuptools import find_packages, setup

here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, 'requirements-base.txt')) as f:
    requirements = [line.split('#')[0].strip() for line in f if line.split('#')[0].strip()]

setup(
    name='gluon_unet',
    version='0.1.0',
    description=__doc__,
    long_description=open(os.path.join(here, 'README.md')).read(),
    long_description_content_type='text/markdown',
    packages=find_packages(include=['gluon_unet', 'gluon_unet.*']),
    python_requires='>=3.8',
    install_requires=requirements,
    # MXNet comes in CPU and CUDA builds of the same module: pick one as an extra,
    # e.g. pip install .[cpu]  or  pip install .[cu117]
    extras_require={'cpu': ['mxnet==1.9.1'], 'cu117': ['mxnet-cu117==1.9.1'], 'test': ['pytest>=7']},
    entry_points={'console_scripts': [
        'gluon-unet-train=gluon_unet.cli:train_main',
        'gluon-unet-predict=gluon_unet.predict:main',
        'gluon-unet-evaluate=gluon_unet.evaluate:main',
        'gluon-unet-export=gluon_unet.export:main',
        'gluon-unet-launch=gluon_unet.launch:main',
    ]},
    license='Apache-2.0',
)
